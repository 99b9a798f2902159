"""Run a spec's forward (or its fla baseline's; --bwd: its forward and backward, after one forward that sizes
the output gradient) twice at one shape, for Nsight Compute to profile one launch of a kernel of it (a later one:
--launch-skip 1 passes the first call's compilation and autotuning):

    ncu --clock-control none -k regex:chunked_states_kernel --launch-skip 1 -c 1 --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
        python3 bench/ncu_forward.py specs/gated_deltanet.yaml [--baseline] [--bwd] [--B 4 --T 8192 --H 16 --D 128]

--baseline runs the spec's first baseline of attngen.bench (fla's op for the linear specs) on the same inputs.
Stall samples and instruction counts of the profiled kernel by source line: add `--section SourceCounters --page
source --print-source cuda,sass --csv` (a table per source file: the kernel's template lines, kernel_lib's and
triton.language's, each row a line with its warp-stall samples and instructions executed).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attngen  # noqa: E402
import attngen.runtime  # noqa: E402
from attngen import bench  # noqa: E402
from attngen.testing import Shape, bench_inputs  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec")
    p.add_argument("--baseline", action="store_true")
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bwd", action="store_true", help="the forward and backward (a random output gradient)")
    args = p.parse_args()
    op = attngen.load(args.spec)
    shape = Shape(batch=args.B, q_len=args.T, heads=args.H, head_dim=args.D, value_dim=args.D)
    inputs = bench_inputs(op.spec, shape, getattr(torch, args.dtype), "cuda", requires_grad=args.bwd)
    if args.baseline:
        scale = attngen.runtime.check_call(op, inputs).scale
        baselines = bench.baselines(op.spec, shape, scale, "cuda")
        if not baselines:
            sys.exit(f"{args.spec}: no baseline in attngen.bench for this spec")
        run = lambda: baselines[0].fn(inputs)  # noqa: E731
    else:
        run = lambda: op(**inputs)  # noqa: E731
    # bench.step: the forward, or (--bwd) a forward + backward with a fixed output gradient (sized by one forward)
    step = bench.step(lambda: (lambda out: out[0] if isinstance(out, tuple) else out)(run()), args.bwd, inputs)
    with torch.set_grad_enabled(args.bwd):
        for _ in range(2):
            step()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
