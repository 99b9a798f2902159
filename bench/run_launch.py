"""One call of a spec at a launch variant, for tools that watch a process's kernels (compute-sanitizer):
no timing, no oracle (bench/probe_launch.py does those).

    compute-sanitizer --tool memcheck python bench/run_launch.py gated_deltanet "output_BV=16" \
        [--B 2 --T 8192 --H 16 --D 128] [--bwd]

The variant is bench/probe_launch.py's: launch knobs set after the planner fitted its launch (its
clamps bypassed), so that a launch the planner holds back can be run and watched.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import probe_launch  # noqa: E402  (overrides the planner's fit on import)
import attngen  # noqa: E402
from attngen.testing import Shape, bench_inputs  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", help="a shipped spec's name (specs/NAME.yaml)")
    p.add_argument("variant", help="'knob=value,...' ('' = the planner's launch)")
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--bwd", action="store_true", help="forward and backward (default: the forward)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("run_launch.py runs the compiled kernels on a CUDA GPU; none is available here")
    probe_launch.OVERRIDE.update(probe_launch.parse_variant(args.variant, "variant"))
    op = attngen.load(probe_launch.SPECS / f"{args.spec}.yaml")
    shape = Shape(batch=args.B, q_len=args.T, heads=args.H, head_dim=args.D, value_dim=args.D)
    inputs = bench_inputs(op.spec, shape, torch.bfloat16, "cuda", requires_grad=args.bwd)
    o = probe_launch.grads(op, inputs)["o"] if args.bwd else probe_launch.output(op(**inputs))
    torch.cuda.synchronize()
    print(f"{args.spec} {args.variant or 'planner'}: ran, mean |o| {o.float().abs().mean().item():.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
