"""A fresh process's first call of a spec (GPU): forward + backward with an empty Triton cache,
compilation included, then the same call again.

    python bench/first_call.py [SPEC] [--B 4 --T 8192 --H 16 --D 128] [--dtype bf16] [--fwd] [--trace]

Prints the seconds of each phase (import, load, first call, second call) and how many kernels
Triton compiled. ATTNGEN_COMPILE_THREADS=1 compiles each kernel at its first launch, one after the
other (plain Triton); the default compiles a call's kernels side by side first (attngen/compiling.py).
--trace also lists how long the dry run waited for the warm threads (attngen/compiling.py: Triton's
one-time work, started at `import attngen` and when the op is made) and each kernel the dry run
compiled: when its job started and ended, in seconds from the dry run's start, and the CPU seconds its
thread spent (compilation and launcher).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

t_start = time.perf_counter()
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="attngen_first_call_")   # nothing compiled yet

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attngen  # noqa: E402
from attngen import compiling  # noqa: E402
from attngen.testing import Shape, bench_inputs, format_shape  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", nargs="?", default=str(Path(__file__).resolve().parents[1] / "specs" / "gated_deltanet.yaml"))
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--fwd", action="store_true", help="the forward alone (no backward)")
    p.add_argument("--trace", action="store_true", help="each compiled kernel's start, end and CPU seconds")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="cProfile the first call's own thread and list its N functions of most cumulative time")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("first_call.py times Triton compilation on a CUDA GPU; none is available here")
    t_import = time.perf_counter() - t_start
    torch.zeros(1, device="cuda")   # the CUDA context, not counted as the call's
    t0 = time.perf_counter()
    op = attngen.load(args.spec)
    t_load = time.perf_counter() - t0
    shape = Shape(batch=args.B, q_len=args.T, heads=args.H, head_dim=args.D, value_dim=args.D)
    inputs = bench_inputs(op.spec, shape, DTYPES[args.dtype], "cuda", requires_grad=not args.fwd)
    compiled = []
    hook = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda *a, **kw: compiled.append(kw.get("fn"))

    def call():
        out = op(**inputs)
        o = out[0] if isinstance(out, tuple) else out
        if not args.fwd:
            o.float().sum().backward()
        torch.cuda.synchronize()

    dry = []   # the seconds of the dry run (compilation) inside the first call
    first = compiling.first_call
    jobs = []  # (kernel, start, end, thread CPU seconds) of each compilation job, from time.perf_counter()
    with_launcher = compiling._with_launcher

    def timed_job(compile_fn, *a, **kw):
        t0, c0 = time.perf_counter(), time.thread_time()
        kernel = with_launcher(compile_fn, *a, **kw)
        jobs.append((getattr(kernel, "name", "?"), t0, time.perf_counter(), time.thread_time() - c0))
        return kernel

    def timed_first_call(kind, dry_run):
        t0 = time.perf_counter()
        for thread in list(compiling._WARM.values()):   # first() joins them too: here to time the wait
            thread.join()
        waited = time.perf_counter() - t0
        first(kind, dry_run)
        dry.append(time.perf_counter() - t0)
        if args.trace and len(dry) == 1:
            print(f"  warm threads ({', '.join(compiling._WARM) or 'none'}) joined after {waited:.2f} s")
            for name, start, end, cpu in sorted(jobs, key=lambda j: j[2]):
                print(f"  {name:<36s} start {start - t0:5.2f} s  end {end - t0:5.2f} s  wall {end - start:5.2f} s  "
                      f"cpu {cpu:5.2f} s")

    compiling.first_call = timed_first_call
    if args.trace:
        compiling._with_launcher = timed_job
    times = []
    for i in range(2):
        if i == 0 and args.profile:
            import cProfile
            import pstats
            profile = cProfile.Profile()
            profile.enable()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        if i == 0 and args.profile:
            profile.disable()
            pstats.Stats(profile).sort_stats("cumulative").print_stats(args.profile)
    triton.knobs.runtime.jit_post_compile_hook = hook
    print(f"{op.spec.name} {format_shape(shape)} {args.dtype} {'forward' if args.fwd else 'forward + backward'}, "
          f"{compiling.threads()} compile thread(s): import {t_import:.1f} s, load {t_load:.2f} s, "
          f"first call {times[0]:.2f} s ({len(compiled)} kernels compiled; dry run {sum(dry[:1]):.2f} s), "
          f"second call {times[1] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
