"""Launch configurations of the softmax kernels searched on the GPU: for each candidate, the
generated module's config function is replaced, the op is run on random bf16 inputs, its output
(and gradients with --bwd) compared with the default configuration's, and timed (do_bench median).

    python bench/tune_softmax.py [--spec softmax_causal] [--bwd] [--B 4 --T 8192 --H 16 --D 128]

Configurations that fail to compile (shared memory, registers) are reported and skipped.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import attngen  # noqa: E402
from attngen.runtime import kernels_for  # noqa: E402
from bench import make, rel  # noqa: E402

SPECS = Path(__file__).resolve().parents[1] / "specs"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--spec", default="softmax_causal")
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--bwd", action="store_true")
    p.add_argument("--budget", type=float, default=240.0, help="seconds before the search stops")
    p.add_argument("--configs", default="", help="candidates to time instead of the whole space, e.g. "
                   "'64,64,4,3,1;64,64,4,3,0' (forward: BM, BN, warps, stages, last_first)")
    args = p.parse_args()
    op = attngen.load(SPECS / f"{args.spec}.yaml")
    module = kernels_for(op)
    B, T, H, D = args.B, args.T, args.H, args.D
    t = make(B, T, H, D, torch.bfloat16, args.bwd, **({"g_scalar": True} if op.spec.decay == "scalar" else {}))
    do = torch.randn(B, T, H, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).bfloat16()

    def run():
        o = op(**t)
        if not args.bwd:
            return [o]
        grads = torch.autograd.grad(o, list(t.values()), do)
        return [o, *grads]

    def step():
        run()

    ref = [x.detach().clone() for x in run()]
    fwd_default, bwd_default = module.softmax_fwd_config, module.softmax_bwd_config
    base_ms = triton.testing.do_bench(step, warmup=10, rep=50, return_mode="median")
    print(f"{args.spec} B{B} T{T} H{H} D{D} bf16 {'fwd+bwd' if args.bwd else 'fwd'}: default {base_ms:.3f} ms")
    if args.bwd:
        kinds = ("dq", "dkdv")
        space = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3)))
    else:
        kinds = ("fwd",)
        space = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4), (True, False)))
    if args.configs:
        space = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";")]
        space = [c[:4] + (bool(c[4]),) if len(c) == 5 else c for c in space]
    start = time.time()
    best = {}
    for kind in kinds:
        rows = []
        for cfg in space:
            if time.time() - start > args.budget:
                print("budget spent")
                break
            if kind == "fwd":
                module.softmax_fwd_config = lambda BK, BV, size, max_len, cfg=cfg: cfg
            else:
                chosen = dict(best)
                chosen[kind] = cfg

                def config(kernel, max_len, BK, BV, size, acc_size, chosen=chosen):
                    return chosen.get(kernel) or bwd_default(kernel, max_len, BK, BV, size, acc_size)
                module.softmax_bwd_config = config
            try:
                got = run()
                torch.cuda.synchronize()
                err = max(rel(a, b) for a, b in zip(got, ref))
                ms = triton.testing.do_bench(step, warmup=10, rep=50, return_mode="median")
            except Exception as e:  # noqa: BLE001
                print(f"  {kind} {cfg}: failed {type(e).__name__}: {str(e)[:80]}", flush=True)
                continue
            ok = err < 2e-2
            rows.append((ms, cfg, err, ok))
            print(f"  {kind} {cfg}: {ms:.3f} ms rel diff {err:.1e}{'' if ok else ' WRONG'}", flush=True)
        module.softmax_fwd_config, module.softmax_bwd_config = fwd_default, bwd_default
        good = sorted(r for r in rows if r[3])
        if good:
            best[kind] = good[0][1]
            print(f"best {kind}: {good[0][1]} {good[0][0]:.3f} ms (default total {base_ms:.3f} ms)", flush=True)


if __name__ == "__main__":
    main()
