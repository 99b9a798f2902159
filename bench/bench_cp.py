"""Context parallelism (attngen.distributed) on N GPUs against 1: correctness against the
single-GPU result, time, speedup, scaling efficiency and the bytes each rank receives per step,
forward and forward + backward, bf16, B1 (one sequence split along time).

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 bench/bench_cp.py \\
        [--T 131072,524288] [--specs gated_deltanet,mamba2,softmax_causal] [--H 16] [--D 128] [--reps 3]
        [--balance | --shards 0.6,0.4]

Every rank builds the same full inputs, times the single-GPU call on all of them (the 1-GPU time,
and the reference), then the context-parallel call on its shard with the same output gradient
(its part); the N-GPU time of a step is the slowest rank's. speedup = t_1 / t_N, efficiency =
speedup / N. Shards are equal unless --balance (softmax attention: shards ending at T sqrt(r/N),
equal causal work) or --shards (fractions of T per rank; with the affine method the ranks after
the first do more work per token). Needs CUDA GPUs and torchrun, one process per GPU.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import attngen  # noqa: E402
from attngen import planner  # noqa: E402
from attngen.distributed import ContextParallel  # noqa: E402
from attngen.testing import LOWP_FLOOR  # noqa: E402
from bench import make, rel  # noqa: E402

SPECS = Path(__file__).resolve().parents[1] / "specs"
EXTRAS = {"scalar": "g_scalar", "vector": "g_vector", "constant": "g_const"}
# A difference from the single-GPU result above bfloat16's floor of attngen.testing is flagged
BOUND = LOWP_FLOOR[torch.bfloat16]


def fail(message: str) -> None:
    sys.exit(f"bench_cp.py: {message}")


def setup() -> tuple[int, int]:
    if not torch.cuda.is_available():
        fail("no CUDA GPU (torch.cuda.is_available() is False); it runs on GPUs, one process each: "
             "torchrun --nproc_per_node N bench/bench_cp.py")
    if "LOCAL_RANK" not in os.environ:
        fail("not launched by torchrun (LOCAL_RANK is not set): torchrun --nproc_per_node N bench/bench_cp.py")
    local = int(os.environ["LOCAL_RANK"])
    if local >= torch.cuda.device_count():
        fail(f"local rank {local} but only {torch.cuda.device_count()} GPUs: ask torchrun for at most that many "
             "processes per node")
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return dist.get_rank(), dist.get_world_size()


def shard_bounds(T: int, ranks: int, balanced: bool, fractions: list[float] | None) -> list[int]:
    """Shard starts and T: equal shards; balanced: equal causal softmax work (queries x keys
    seen); fractions: the given part of T per rank. Inner bounds at multiples of 128 tokens."""
    if fractions:
        if len(fractions) != ranks or min(fractions) <= 0:
            fail(f"--shards: expected {ranks} positive fractions (one per rank), got {fractions}")
        ends = [sum(fractions[:j]) / sum(fractions) for j in range(1, ranks)]
    elif balanced:
        ends = [(j / ranks) ** 0.5 for j in range(1, ranks)]
    else:
        ends = [j / ranks for j in range(1, ranks)]
    return [0, *(round(T * e / 128) * 128 for e in ends), T]


def step_time(fn, bwd: bool, inputs: dict, grad_out, reps: int) -> tuple[float, dict]:
    """Milliseconds per call of fn (with bwd, forward + backward with output gradient grad_out),
    after one warm-up call; and the last call's output and input gradients."""
    def step():
        for t in inputs.values():
            t.grad = None
        out = fn()
        if bwd:
            out.backward(grad_out)
        return out

    step()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        out = step()
    end.record()
    torch.cuda.synchronize()
    result = {"o": out.detach()}
    result.update({f"d{n}": t.grad for n, t in inputs.items() if bwd and t.grad is not None})
    return start.elapsed_time(end) / reps, result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--T", default="131072,524288")
    p.add_argument("--specs", default="gated_deltanet,mamba2,softmax_causal")
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--balance", action="store_true", help="softmax: shards of equal causal work")
    p.add_argument("--shards", default="", help="fractions of T per rank, e.g. 0.6,0.4 (all specs)")
    args = p.parse_args()
    rank, ranks = setup()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{ranks} GPUs ({torch.cuda.get_device_name()}), torch {torch.__version__}, B1 H{args.H} D{args.D} bf16, "
        f"{args.reps} timed steps after one warm-up; ms per step; bytes: what each rank receives per step "
        f"(fwd+bwd rows: forward and backward); diff: the largest relative difference of o (and of every input "
        f"gradient, fwd+bwd) from the single-GPU call, flagged above {BOUND:g}")
    say(f"{'spec':<16s} {'method':<7s} {'T':>7s} {'pass':<8s} {'1 GPU':>9s} {f'{ranks} GPUs':>9s} {'speedup':>7s} "
        f"{'effic.':>6s} {'Mtok/s':>7s} {'bytes':>10s} {'diff':>9s}  shards")
    for name in args.specs.split(","):
        op = attngen.load(SPECS / f"{name}.yaml")
        cp = ContextParallel(op)
        method = cp.parallel.method
        extras = {EXTRAS[op.spec.decay]: True} if op.spec.decay in EXTRAS else {}
        if op.spec.is_linear and op.spec.update == "delta":
            extras["beta"] = True
        for T in (int(t) for t in args.T.split(",")):
            bounds = shard_bounds(T, ranks, args.balance and method == "keys",
                                  [float(x) for x in args.shards.split(",") if x])
            a, b = bounds[rank], bounds[rank + 1]
            lengths = [y - x for x, y in zip(bounds, bounds[1:])]
            full = make(1, T, args.H, args.D, torch.bfloat16, True, **extras)
            mine = {n: (t if n == "g" and t.dim() == 1 else t[:, a:b]).detach().requires_grad_(True)
                    for n, t in full.items()}
            first = (lambda out: out[0]) if op.spec.is_linear else (lambda out: out)
            gen = torch.Generator(device="cuda").manual_seed(1)
            grad_out = torch.randn(1, T, args.H, args.D, device="cuda", generator=gen, dtype=torch.bfloat16)
            bufs = planner.exchange_elements(op.spec, method, 1, max(lengths), args.H, args.H, args.D, args.D,
                                             packed=False)
            each = sum(n * (2 if kind == "input" else 4) for _, n, kind in bufs)
            for bwd in (False, True):
                ms1, want = step_time(lambda: first(op(**full)), bwd, full, grad_out, args.reps)
                msn, got = step_time(lambda: first(cp(**mine, shard_lengths=lengths)), bwd, mine, grad_out[:, a:b],
                                     args.reps)
                # a constant decay's g [H] is every rank's: each holds a part of its gradient
                diffs = [rel(got[n], want[n][:, a:b]) for n in got if want[n].dim() > 1]
                stats = torch.tensor([msn, max(diffs)], device="cuda")
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
                msn, diff = stats.tolist()
                speedup = ms1 / msn
                say(f"{name:<16s} {method:<7s} {T:>7d} {'fwd+bwd' if bwd else 'fwd':<8s} {ms1:9.2f} {msn:9.2f} "
                    f"{speedup:7.2f} {speedup / ranks:6.2f} {T / msn / 1e3:7.2f} "
                    f"{each * (ranks - 1) * (2 if bwd else 1) / 2**20:7.2f}MiB {diff:9.2e}"
                    f"{'' if diff <= BOUND else ' (above)'}  {lengths}", flush=True)
            full = mine = grad_out = None    # freed before the next length's inputs
            torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
