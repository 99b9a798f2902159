"""Peak memory of a forward + backward through the kernels, counted on the CPU (no GPU, no kernel runs).

    python bench/peak_memory.py SPEC... [--shape 4,8192,16,128,128] [--dtype bf16] [--fwd] [--launch "knob=value,..."]

The op runs on CPU tensors through the kernels' host code (ATTNGEN_BACKEND=triton, Triton's
interpreter), every kernel launch a no-op: the buffers are allocated and released exactly as a GPU
call allocates and releases them, but nothing is computed (the outputs are garbage and are not
looked at), so full-size shapes take seconds. The peak is that of the allocations made during one
training step of `attngen bench --bwd` (attngen.bench.step: forward, backward with a fixed output
gradient, the gradients released), from the PyTorch profiler's memory records: what bench.py's
peak column reports on a GPU (torch.cuda.max_memory_allocated above the memory held before the
step), less the CUDA allocator's rounding of each block. The launch is the planner's default (the
shipped tables are for GPUs); --launch sets chunked launch knobs over it as bench/probe_launch.py's
variants do.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: @triton.jit makes interpreted functions

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attngen  # noqa: E402
from attngen import bench, tuning  # noqa: E402
from attngen.testing import Shape, bench_inputs, parse_shape  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def no_launches():
    """Every kernel launch a no-op, the kernels' host code on CPU tensors (ATTNGEN_BACKEND=triton)."""
    run, backend = InterpretedFunction.run, os.environ.get("ATTNGEN_BACKEND")
    InterpretedFunction.run = lambda self, *a, grid, warmup, **kw: None
    os.environ["ATTNGEN_BACKEND"] = "triton"
    try:
        yield
    finally:
        InterpretedFunction.run = run
        if backend is None:
            os.environ.pop("ATTNGEN_BACKEND")
        else:
            os.environ["ATTNGEN_BACKEND"] = backend


def peak_of(op, shape: Shape, dtype: torch.dtype, bwd: bool = True) -> int:
    """The peak bytes allocated during one forward + backward step (bench.step; bwd False: one
    forward without autograd, as inference runs it) beyond those held before it."""
    inputs = bench_inputs(op.spec, shape, dtype, "cpu", requires_grad=bwd)
    run = bench.step(lambda: op(**inputs)[0] if op.spec.is_linear else op(**inputs), bwd, inputs)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, torch.set_grad_enabled(bwd):
        run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("specs", nargs="+")
    p.add_argument("--shape", default="4,8192,16,128,128", help="B,T,H,K,V")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--fwd", action="store_true", help="one forward without autograd (inference) instead of a training step")
    p.add_argument("--launch", default="", help="chunked launch knobs set over the planner's, 'knob=value,...'")
    args = p.parse_args()
    shape, dtype = parse_shape(args.shape), DTYPES[args.dtype]
    if args.launch:
        # probe_launch's variants: knobs set over the fitted launch (planner.fit_chunked, patched there)
        import probe_launch
        probe_launch.OVERRIDE.update(probe_launch.parse_variant(args.launch, "--launch"))
    step = "forward (no autograd)" if args.fwd else "forward + backward"
    print(f"{step}, {args.dtype}, shape {args.shape}, kernels' host code on the CPU (no kernel runs)")
    for path in args.specs:
        op = attngen.load(path)
        tuning._remembered.cache_clear()
        with no_launches():
            peak = peak_of(op, shape, dtype, bwd=not args.fwd)
        print(f"{op.spec.name:<20s} peak {peak / 2**20:8.0f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
