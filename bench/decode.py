"""Decode step timings (GPU): gated deltanet H16 K=V=128 bf16 inputs, float32 state, one token of
B sequences whose states live in a StateCache, eager and replayed from a CUDA graph, against
fla's fused recurrent gated delta rule (initial_state in, final state out: its decode; eager and
graph, when fla is installed), outputs compared.

    python bench/decode.py [--batch 1,64,256] [--slots 512]
    python bench/decode.py --softmax [--batch 1,64] [--keys 32768] [--host] [--no-flex] [--spec NAME]

--softmax: softmax_causal's decode step (or --spec's: forgetting_attention, whose held G and new gates are
random log decays near 0, against SDPA with the decay's bias as a bf16 attn_mask, no FlexAttention)
(op.prepare_decode on a StateCache whose slots hold --keys - 1
keys: each step appends one and attends to --keys, split over the keys), eager and from a graph, each
step with the cache lengths set back (a fill_ of B ints, in the timed call) so every step reads the
same keys; per step of a graph of STEPS steps with one fill_ before them (the steps read --keys -
STEPS + 1 to --keys keys); against SDPA and FlexAttention (compiled) of one query on [B, H, keys, D]
contiguous keys and values, SDPA also per call of a graph of STEPS calls; the effective cache
bandwidth (keys and values read once) of the graph of one step; then the GPU time of each kernel of
an eager step (torch.profiler, mean of 50 steps, slowest first).

--host (with --softmax): per batch, where the eager step's host time goes: the step's wall time per call
on the host (no sync; the GPU runs behind), and the part of it spent inside each Triton launch
(softmax_fwd_kernel, which appends the keys and merges the split-KV partials inside it; kv_append_kernel
where a step launches it) and in the cache lengths' fill_.

Per row: microseconds per step (median of do_bench): eager, replayed from a graph of one step,
and per step of a graph of STEPS steps (as a served model replays one graph per token, whose
launch cost its layers share); the effective state bandwidth (the state read and written once per
step) of the graph of one step, and the copy ceiling beside it: a graph of one copy_ of the same
bytes (read and written once; `of copy` the step's share of it). The first line gives the floor: a
graph of one tiny kernel.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attngen  # noqa: E402
from attngen import runtime  # noqa: E402
from attngen.bench import profile  # noqa: E402
from attngen.kernel_lib import LOG2E, softmax_decay_pairs  # noqa: E402

H, K, V = 16, 128, 128
STEPS = 16


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up call): a function replaying it."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def softmax_decode(batches: list[int], keys: int, with_flex: bool = True, spec: str = "softmax_causal") -> None:
    """Rows of a softmax spec's prepared decode step against SDPA and FlexAttention (see the header)."""
    op = attngen.load(Path(__file__).resolve().parents[1] / "specs" / f"{spec}.yaml")
    decay = op.spec.decay == "scalar"
    sdpa = torch.nn.functional.scaled_dot_product_attention
    flex = None
    try:
        if with_flex and not decay:
            from torch.nn.attention.flex_attention import flex_attention
            flex = torch.compile(flex_attention)
    except ImportError as e:
        print(f"FlexAttention unavailable ({e})")
    print(f"{spec} decode, one query against {keys} keys, H{H} D{K} bf16" +
          (" (SDPA with the decay bias as a bf16 attn_mask)" if decay else ""))
    print(f"{'B':>5} {'eager us':>9} {'graph us':>9} {f'x{STEPS} us':>7} {'TB/s':>6} {'SDPA us':>8} "
          f"{f'x{STEPS} us':>7} {'Flex us':>8} {'rel diff':>9}")
    torch.manual_seed(0)
    kernels = []
    for batch in map(int, batches):
        cache = attngen.StateCache(op, slots=batch, heads=H, head_dim=K, value_dim=V, device="cuda",
                                   dtype=torch.bfloat16, max_len=keys, **(dict(query_heads=H) if decay else {}))
        cache.k.normal_()
        cache.v.normal_()
        cache.lengths.fill_(keys - 1)
        slots = torch.arange(batch, device="cuda", dtype=torch.int32)
        q, k, v = (torch.randn(batch, 1, H, D, device="cuda", dtype=torch.bfloat16) for D in (K, K, V))
        gate = {}
        if decay:
            # the held positions' G (log2 units, float pairs): the cumsum of log decays near 0
            held = torch.nn.functional.logsigmoid(torch.randn(batch, keys, H, device="cuda", dtype=torch.float64) + 6)
            cache.g_hi[:, :keys], cache.g_lo[:, :keys] = softmax_decay_pairs(held, None, False)
            g = torch.nn.functional.logsigmoid(torch.randn(batch, 1, H, device="cuda") + 6)
            gate = dict(g=g.to(torch.bfloat16))
        with torch.no_grad():
            step = op.prepare_decode(cache, batch, dtype=torch.bfloat16)

            def one():
                cache.lengths.fill_(keys - 1)
                return step(q, k, v, slots=slots, **gate)

            def steps():
                cache.lengths.fill_(keys - STEPS)
                for _ in range(STEPS):
                    step(q, k, v, slots=slots, **gate)

            t_eager = us(one)
            t_graph = us(graphed(one))
            t_steps = us(graphed(steps)) / STEPS
            kernels.append((batch, profile(one, reps=50)))
            o = one()
            # the baselines' layout [B, H, keys, D], the new token's key and value in place
            kt, vt = (c[:, :keys].transpose(1, 2).contiguous() for c in (cache.k, cache.v))
            qt = q.transpose(1, 2).contiguous()
            bias = None
            if decay:
                # [B, H, 1, keys] the query's G minus each key's, natural log units
                G = (cache.g_hi[:, :keys].to(torch.float64) + cache.g_lo[:, :keys].to(torch.float64)) / LOG2E
                bias = (G[:, -1:] - G).permute(0, 2, 1)[:, :, None].contiguous()
            mask = bias.to(torch.bfloat16) if decay else None
            t_sdpa = us(lambda: sdpa(qt, kt, vt, attn_mask=mask))
            t_sdpa_steps = us(graphed(lambda: [sdpa(qt, kt, vt, attn_mask=mask) for _ in range(STEPS)])) / STEPS
            ref = sdpa(qt.float(), kt.float(), vt.float(), attn_mask=bias.float() if decay else None).transpose(1, 2)
            t_flex = us(lambda: flex(qt, kt, vt)) if flex is not None else float("nan")
            diff = float((o.float() - ref.float()).norm() / ref.float().norm())
        read = batch * keys * H * (K + V) * 2   # bf16 keys and values
        print(f"{batch:>5} {t_eager:>9.1f} {t_graph:>9.1f} {t_steps:>7.1f} {read / t_graph / 1e6:>6.2f} {t_sdpa:>8.1f} "
              f"{t_sdpa_steps:>7.1f} {t_flex:>8.1f} {diff:>9.1e}")
    print("kernels of an eager step, mean GPU us (torch.profiler)")
    for batch, times in kernels:
        print(f"{batch:>5} " + "  ".join(f"{name[:32]} {t:.1f}" for name, t in times))


class _Timed:
    """A Triton kernel whose launches add their host time to `spent[name]`."""

    def __init__(self, kernel, name: str, spent: dict):
        self.kernel, self.name, self.spent = kernel, name, spent

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = launch(*args, **kwargs)
            self.spent[self.name] = self.spent.get(self.name, 0.0) + time.perf_counter() - start
            return out
        return timed


def softmax_decode_host(batches: list[int], keys: int, calls: int = 2000) -> None:
    """Where the eager softmax decode step's host time goes (see the header)."""
    op = attngen.load(Path(__file__).resolve().parents[1] / "specs" / "softmax_causal.yaml")
    module = runtime.kernels_for(op)
    names = ("kv_append_kernel", "softmax_fwd_kernel")
    print(f"softmax_causal decode host time per step (us), one query against {keys} keys, H{H} D{K} bf16, "
          f"median over {calls} calls of blocks of 100")
    print(f"{'B':>5} {'step':>7} {'fill_':>7} " + " ".join(f"{n.removesuffix('_kernel'):>14}" for n in names)
          + f" {'rest':>7}")
    for batch in map(int, batches):
        cache = attngen.StateCache(op, slots=batch, heads=H, head_dim=K, value_dim=V, device="cuda",
                                   dtype=torch.bfloat16, max_len=keys)
        cache.lengths.fill_(keys - 1)
        slots = torch.arange(batch, device="cuda", dtype=torch.int32)
        q, k, v = (torch.randn(batch, 1, H, D, device="cuda", dtype=torch.bfloat16) for D in (K, K, V))
        spent: dict = {}
        originals = {n: getattr(module, n) for n in names}
        try:
            for n in names:
                setattr(module, n, _Timed(originals[n], n, spent))
            with torch.no_grad():
                step = op.prepare_decode(cache, batch, dtype=torch.bfloat16)
                step(q, k, v, slots=slots)
                torch.cuda.synchronize()
                rows = []
                for _ in range(calls // 100):
                    spent.clear()
                    t_fill = t_step = 0.0
                    for _ in range(100):
                        start = time.perf_counter()
                        cache.lengths.fill_(keys - 1)
                        mid = time.perf_counter()
                        step(q, k, v, slots=slots)
                        end = time.perf_counter()
                        t_fill, t_step = t_fill + mid - start, t_step + end - mid
                    torch.cuda.synchronize()
                    rows.append((t_step, t_fill, *(spent.get(n, 0.0) for n in names)))
        finally:
            for n in names:
                setattr(module, n, originals[n])
        med = [statistics.median(r[i] for r in rows) * 1e6 / 100 for i in range(2 + len(names))]
        rest = med[0] - sum(med[2:])
        print(f"{batch:>5} {med[0]:>7.1f} {med[1]:>7.1f} " + " ".join(f"{x:>14.1f}" for x in med[2:]) + f" {rest:>7.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default=None, help="default 1,64,256 (--softmax: 1,64)")
    parser.add_argument("--slots", type=int, default=512)
    parser.add_argument("--softmax", action="store_true", help="a softmax spec's decode against SDPA and Flex")
    parser.add_argument("--keys", type=int, default=32768, help="--softmax: the keys each query attends to")
    parser.add_argument("--host", action="store_true", help="--softmax: where the eager step's host time goes")
    parser.add_argument("--no-flex", action="store_true", help="--softmax: no FlexAttention (its compilation)")
    parser.add_argument("--spec", default="softmax_causal",
                        help="--softmax: a shipped softmax spec (forgetting_attention: SDPA takes the decay as a bias)")
    args = parser.parse_args()
    if args.softmax and args.host:
        softmax_decode_host((args.batch or "1,64").split(","), args.keys)
        return
    if args.softmax:
        softmax_decode((args.batch or "1,64").split(","), args.keys, not args.no_flex, args.spec)
        return
    args.batch = args.batch or "1,64,256"
    op = attngen.load(Path(__file__).resolve().parents[1] / "specs" / "gated_deltanet.yaml")
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError as e:
        fused_recurrent_gated_delta_rule = None
        print(f"fla unavailable ({e}): attngen alone")
    tiny = torch.zeros(16, device="cuda")
    print(f"floor: a graph of one tiny kernel (add_ on 16 floats) {us(graphed(lambda: tiny.add_(1))):.1f} us")
    print(f"{'B':>5} {'eager us':>9} {'graph us':>9} {f'x{STEPS} us':>7} {'TB/s':>6} {'copy TB/s':>9} {'of copy':>7} "
          f"{'fla eager':>10} {'fla graph':>10} {f'x{STEPS} us':>7} {'rel diff':>9}")
    torch.manual_seed(0)
    for batch in map(int, args.batch.split(",")):
        x = dict(q=torch.randn(batch, 1, H, K), k=torch.randn(batch, 1, H, K), v=torch.randn(batch, 1, H, V),
                 g=torch.nn.functional.logsigmoid(torch.randn(batch, 1, H) + 2), beta=torch.rand(batch, 1, H))
        x = {n: t.cuda().to(torch.bfloat16 if n in ("q", "k", "v") else torch.float32) for n, t in x.items()}
        cache = attngen.StateCache(op, slots=max(args.slots, batch), heads=H, head_dim=K, value_dim=V, device="cuda")
        cache.state.normal_(0, 0.1)
        slots = torch.randperm(cache.num_slots, device="cuda")[:batch].to(torch.int32)
        start = cache.state[slots.long()].clone()
        with torch.no_grad():
            step = op.prepare_decode(cache, batch, dtype=torch.bfloat16)
            t_eager = us(lambda: step(**x, slots=slots))
            t_graph = us(graphed(lambda: step(**x, slots=slots)))
            t_steps = us(graphed(lambda: [step(**x, slots=slots) for _ in range(STEPS)])) / STEPS
            copied = torch.empty_like(start)
            t_copy = us(graphed(lambda: copied.copy_(start)))
            row = (f"{batch:>5} {t_eager:>9.1f} {t_graph:>9.1f} {t_steps:>7.1f} "
                   f"{2 * start.numel() * 4 / t_graph / 1e6:>6.2f} {2 * start.numel() * 4 / t_copy / 1e6:>9.2f} "
                   f"{t_copy / t_graph:>7.2f}")
            if fused_recurrent_gated_delta_rule is not None:
                # fla's decode as served before the cache: the batch's states in, new final states
                # out (its keys and queries l2-normalized beforehand, as attngen's spec does)
                q_n = torch.nn.functional.normalize(x["q"].float(), dim=-1).to(torch.bfloat16)
                k_n = torch.nn.functional.normalize(x["k"].float(), dim=-1).to(torch.bfloat16)

                def fla_step():
                    # (keywords: its fifth positional parameter is a per-key decay gk, not beta)
                    return fused_recurrent_gated_delta_rule(q_n, k_n, x["v"], g=x["g"], beta=x["beta"], scale=K ** -0.5,
                                                            initial_state=start, output_final_state=True)

                t_fla = us(fla_step)
                t_fla_graph = us(graphed(fla_step))
                t_fla_steps = us(graphed(lambda: [fla_step() for _ in range(STEPS)])) / STEPS
                cache.state[slots.long()] = start
                o = step(**x, slots=slots)
                o_fla = fla_step()[0]
                diff = float((o.float() - o_fla.float()).norm() / o_fla.float().norm())
                row += f" {t_fla:>10.1f} {t_fla_graph:>10.1f} {t_fla_steps:>7.1f} {diff:>9.1e}"
        print(row)


if __name__ == "__main__":
    main()
