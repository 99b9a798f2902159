"""The benchmark of BENCHMARKS.md by case name: `attngen bench` (attngen/bench.py) at B4 T8192
H16 D128 bf16 for the shipped specs against flash-linear-attention, SDPA and FlexAttention, plus
decode (one query against the cache) and grouped-query heads (H 32 over 8).

    python bench/bench.py [--bwd | --passes fwd,bwd] [--profile] [--cases gdn,delta,...] [--B 4 --T 8192 --H 16 --D 128] [--no-baseline]

Prints `attngen bench`'s table: ms, the ratio to the baseline, TFLOP/s, the fraction of the memory
floor (bytes of inputs and outputs at the measured copy bandwidth), peak memory, and the relative
difference of the baseline's output from attngen's; --profile lists each implementation's kernels under its row.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attngen import bench, load_spec  # noqa: E402
from attngen.testing import parse_shape  # noqa: E402

SPECS = Path(__file__).resolve().parents[1] / "specs"

# case -> (spec file or dict, shape from B, T, H, D, the baselines it is timed against)
CASES = {
    "gdn": ("gated_deltanet", "{B},{T},{H},{D},{D}", ("fla",)),
    "delta": ("deltanet", "{B},{T},{H},{D},{D}", ("fla",)),
    "mamba2": ("mamba2", "{B},{T},{H},{D},{D}", ("fla",)),
    "retnet": ("retnet", "{B},{T},{H},{D},{D}", ("fla",)),
    "gla": ("gla", "{B},{T},{H},{D},{D}", ("fla",)),
    "kda": ("kda", "{B},{T},{H},{D},{D}", ("fla",)),
    "linear": ({"name": "linear_attention", "attention": "linear"}, "{B},{T},{H},{D},{D}", ("fla",)),
    "linear_elu_sum": ("linear_transformer", "{B},{T},{H},{D},{D}", ("fla",)),
    "softmax_causal": ("softmax_causal", "{B},{T},{H},{D},{D}", ("flex",)),
    "softmax_causal_sdpa": ("softmax_causal", "{B},{T},{H},{D},{D}", ("sdpa",)),
    "decode_sdpa": ("softmax_causal", "{B},{T},{H},{D},{D},1", ("sdpa",)),
    "decode_flex": ("softmax_causal", "{B},{T},{H},{D},{D},1", ("flex",)),
    "gqa_flex": ("softmax_causal", "{B},{T},32,{D},{D},{T},8", ("flex",)),
    "sliding_window": ("sliding_window", "{B},{T},{H},{D},{D}", ("flex",)),
    "forgetting": ("forgetting_attention", "{B},{T},{H},{D},{D}", ("fla", "flex")),
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--bwd", action="store_true", help="forward + backward (same as --passes bwd)")
    p.add_argument("--passes", default="", help="fwd, bwd or fwd,bwd: both in one process (the baselines'"
                   " autotuning is done once)")
    p.add_argument("--cases", default="", help=f"comma-separated, of {', '.join(CASES)} (default: all)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-baseline", action="store_true", help="time attngen alone")
    args = p.parse_args()
    wanted = [c for c in args.cases.split(",") if c] or list(CASES)
    unknown = [c for c in wanted if c not in CASES]
    if unknown:
        p.error(f"--cases: {', '.join(unknown)} unknown; cases: {', '.join(CASES)}")
    passes = [q for q in args.passes.split(",") if q] or (["bwd"] if args.bwd else ["fwd"])
    if any(q not in ("fwd", "bwd") for q in passes):
        p.error(f"--passes: {args.passes!r}; allowed: fwd, bwd or fwd,bwd")
    reason = bench.no_device_reason()
    if reason:
        print(f"bench.py: {reason}", file=sys.stderr)
        return 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = lambda line: print(line, flush=True)  # noqa: E731
    if "bwd" in passes and not args.no_baseline:
        bench.fla_backward_guard(report)
    failed = False
    for pass_ in passes:
        bwd = pass_ == "bwd"
        report(f"\n{'fwd+bwd' if bwd else 'fwd'}, bf16, do_bench median\n{bench.HEADER}")
        for name in wanted:
            spec, shape, vs = CASES[name]
            spec = load_spec(SPECS / f"{spec}.yaml" if isinstance(spec, str) else spec)
            shape = parse_shape(shape.format(B=args.B, T=args.T, H=args.H, D=args.D))
            rows = bench.bench_case(spec, shape, torch.bfloat16, device, bwd, () if args.no_baseline else vs,
                                    report=report, profile_kernels=args.profile)
            failed |= any(row.impl == "attngen" and row.note.startswith("failed") for row in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
