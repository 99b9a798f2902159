"""Host time of one decode call (Python: checks, planning, dispatch, allocation), without the kernel.

    python bench/decode_host.py [--spec gated_deltanet] [--batch 1,64,256] [--keys 32768]

Runs on the CPU: the token loop's launch is replaced by a no-op, so what is timed is everything
a decode call does on the host before the launch (Triton's own launch cost comes on top on a GPU).
Three ways to decode one token of B sequences, H16 K=V=128 bf16 inputs:
- state: the op with initial_state and output_final_state (the only way before the cache);
- cache: the op on a StateCache with slot indices;
- step: a decode step prepared once (op.prepare_decode).
A softmax spec: one query per sequence against --keys keys and values, the op called with them (its
forward and split-KV merge launches replaced by no-ops).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["ATTNGEN_BACKEND"] = "triton"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import attngen  # noqa: E402
from attngen import runtime  # noqa: E402
from attngen.testing import Shape, random_inputs  # noqa: E402

H, K, V = 16, 128, 128


class NoLaunch:
    """A kernel whose launch does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **meta: None


def per_call_us(fn, calls: int, repeats: int = 7) -> float:
    """Median over repeats of the mean time of `calls` calls, in microseconds."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default="gated_deltanet")
    parser.add_argument("--batch", default=None, help="default 1,64,256 (linear), 1 (softmax)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--keys", type=int, default=32768, help="softmax specs: keys per sequence")
    args = parser.parse_args()
    op = attngen.load(Path(__file__).resolve().parents[1] / "specs" / f"{args.spec}.yaml")
    if not op.spec.is_linear:
        module = runtime.kernels_for(op)
        module.softmax_fwd_kernel = NoLaunch()
        print(f"{args.spec}: host time per call (us) of one query against {args.keys} keys, H{H} K=V={K} bf16, "
              "kernel launches not included")
        print(f"{'B':>5} {'op':>8}")
        for batch in map(int, (args.batch or "1").split(",")):
            q = torch.randn(batch, 1, H, K, dtype=torch.bfloat16)
            k, v = (torch.randn(batch, args.keys, H, K, dtype=torch.bfloat16) for _ in range(2))
            with torch.no_grad():
                print(f"{batch:>5} {per_call_us(lambda: op(q, k, v), args.calls):>8.1f}")
        return
    runtime.kernels_for(op).recurrent_fwd_kernel = NoLaunch()
    print(f"{args.spec}: host time per decode call (us), H{H} K=V={K} bf16, kernel launch not included")
    print(f"{'B':>5} {'state':>8} {'cache':>8} {'step':>8}")
    for batch in map(int, (args.batch or "1,64,256").split(",")):
        x = random_inputs(op.spec, Shape(batch, 1, H, K, V), dtype=torch.bfloat16, initial_state=False)
        cache = attngen.StateCache(op, slots=batch, heads=H, head_dim=K, value_dim=V)
        slots = torch.arange(batch, dtype=torch.int32)
        state = cache.state.clone()
        step = op.prepare_decode(cache, batch, dtype=torch.bfloat16)
        with torch.no_grad():
            t_state = per_call_us(lambda: op(**x, initial_state=state, output_final_state=True), args.calls)
            t_cache = per_call_us(lambda: op(**x, cache=cache, slots=slots), args.calls)
            t_step = per_call_us(lambda: step(**x, slots=slots), args.calls)
        print(f"{batch:>5} {t_state:>8.1f} {t_cache:>8.1f} {t_step:>8.1f}")


if __name__ == "__main__":
    main()
