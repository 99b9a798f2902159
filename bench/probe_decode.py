"""Try launches of the decode step's token-loop kernel (value lanes per program, warps) that its
launcher does not choose: gated deltanet H16 K=V=128, bf16 inputs, float32 state in a StateCache,
one token per sequence. Per batch and launch: the new outputs and cache rows against the
launcher's own (bit for bit: the same kernel, other tiles of the value axis), and on a GPU the
step's time in a CUDA graph of one step and per step of a graph of 16, with the effective state
bandwidth (state read and written once per step).

    python bench/probe_decode.py [--batch 1,64,256] [--launches "64,4;128,4;128,8;32,2"] [--device cuda]
        [--module FILE]

A launch is "BV,warps". The kernel is the generated module's recurrent_fwd_kernel, launched here
as its recurrent_launch does but for those two values. On a CPU (Triton's interpreter: use small
batches) it checks and times nothing else.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import attngen  # noqa: E402
from attngen import runtime  # noqa: E402
from decode import H, K, STEPS, V, graphed, us  # noqa: E402  (bench/decode.py: the same step, shapes and timers)


def launcher(module, normalized: bool, BV: int, warps: int):
    """A stand-in for module.recurrent_launch at value block BV and `warps` warps."""
    def recurrent_launch(B, T, H, K, V, F, N, varlen, has_h0, store_ht, indexed, qk_group=1):
        VS = V + 1 if normalized else V
        meta = dict(BK=triton.next_power_of_2(K), BF=triton.next_power_of_2(F), BV=BV, IS_VARLEN=varlen,
                    HAS_H0=has_h0, STORE_HT=store_ht, STATE_INDEXED=indexed, QK_GROUP=qk_group, num_warps=warps)
        grid = (N * H * triton.cdiv(V, BV),)

        def run(q, k, v, g, beta, omega, h0, o, ht, cu_seqlens, state_indices, S, scale):
            module.recurrent_fwd_kernel[grid](q, k, v, g, beta, omega, h0, o, ht, cu_seqlens, state_indices,
                                              T, S, H, K, V, F, VS, scale, K ** -0.25, F ** -0.5, **meta)
        return run
    return recurrent_launch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,64,256")
    p.add_argument("--launches", default="8,1;16,1;32,2;64,4;64,2;128,4;128,8")
    p.add_argument("--slots", type=int, default=512)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--module", default=None, metavar="FILE", help="an edited excerpt of gated_deltanet's rendering: "
                   "imports, recurrent_fwd_kernel, recurrent_launch")
    args = p.parse_args(argv)
    launches = [tuple(map(int, item.split(","))) for item in args.launches.split(";") if item]
    device = torch.device(args.device)
    op = attngen.load(Path(__file__).resolve().parents[1] / "specs" / "gated_deltanet.yaml")
    module = runtime.kernels_for(op)
    own = module.recurrent_launch
    edited = []
    if args.module:
        from attngen import codegen
        edited = [("edited", codegen._import("probe_decode_edited_module", Path(args.module).resolve()).recurrent_launch)]
    print(f"{'B':>5} {'launch':>14} {'graph us':>9} {f'x{STEPS} us':>7} {'TB/s':>6}  same as the launcher's")
    for batch in map(int, args.batch.split(",")):
        gen = torch.Generator().manual_seed(batch)
        x = dict(q=torch.randn(batch, 1, H, K, generator=gen), k=torch.randn(batch, 1, H, K, generator=gen),
                 v=torch.randn(batch, 1, H, V, generator=gen),
                 g=torch.nn.functional.logsigmoid(torch.randn(batch, 1, H, generator=gen) + 2),
                 beta=torch.rand(batch, 1, H, generator=gen))
        x = {n: t.to(device, torch.bfloat16 if n in ("q", "k", "v") else torch.float32) for n, t in x.items()}
        cache = attngen.StateCache(op, slots=max(args.slots, batch), heads=H, head_dim=K, value_dim=V, device=device)
        cache.state.normal_(0, 0.1)
        start = cache.state.clone()
        slots = torch.randperm(cache.num_slots, device=device)[:batch].to(torch.int32)
        results = {}
        for label, make in [("launcher", own)] + [(f"BV={bv} warps={w}", launcher(module, op.spec.normalize == "sum", bv, w))
                                                  for bv, w in launches] + edited:
            module.recurrent_launch = make
            try:
                with torch.no_grad():
                    cache.state.copy_(start)
                    step = op.prepare_decode(cache, batch, dtype=torch.bfloat16)
                    o = step(**x, slots=slots).clone()
                    results[label] = (o, cache.state[slots.long()].clone())
                    ref_o, ref_s = results["launcher"]
                    same = bool(torch.equal(o, ref_o) and torch.equal(results[label][1], ref_s))
                    if not same:
                        same = f"no: largest rel diff {max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in ((o, ref_o), (results[label][1], ref_s))):.1e}"
                    timing = ""
                    if device.type == "cuda":
                        t_graph = us(graphed(lambda: step(**x, slots=slots)))
                        t_steps = us(graphed(lambda: [step(**x, slots=slots) for _ in range(STEPS)])) / STEPS
                        tbps = 2 * batch * H * K * V * 4 / t_graph / 1e6
                        timing = f"{t_graph:>9.1f} {t_steps:>7.1f} {tbps:>6.2f}"
                    else:
                        timing = f"{'-':>9} {'-':>7} {'-':>6}"
                    print(f"{batch:>5} {label:>14} {timing}  {same}", flush=True)
            except Exception as e:  # noqa: BLE001 -- a launch that fails is a row saying why
                print(f"{batch:>5} {label:>14} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
            finally:
                module.recurrent_launch = own
    return 0


if __name__ == "__main__":
    sys.exit(main())
