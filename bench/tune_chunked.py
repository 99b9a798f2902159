"""Value-block width and warps of the chunked linear forward's steps searched on the GPU: for each
candidate, the generated module's chunked_launch is replaced for the chosen steps (prepare, states,
output; all by default), the forward is run on random bf16 inputs, its output compared with the
default configuration's, timed (do_bench median) and profiled per kernel. Each candidate may run
in its own process (--isolate): an illegal address poisons the process's CUDA context for the
candidates after it.

    python bench/tune_chunked.py [--spec gla] [--steps output] [--configs "32,2;64,2;64,4"] [--isolate]
        [--B 4 --T 8192 --H 16 --D 128]

Configurations that fail to compile (shared memory, registers) are reported and skipped.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import attngen  # noqa: E402
from attngen.runtime import kernels_for  # noqa: E402
from bench import make, profile, rel  # noqa: E402

SPECS = Path(__file__).resolve().parents[1] / "specs"
EXTRAS = {"scalar": "g_scalar", "vector": "g_vector", "constant": "g_const"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--spec", default="gla")
    p.add_argument("--configs", default="32,2;64,2;64,4;128,4", help="candidates 'BV,warps;...'")
    p.add_argument("--steps", default="prepare,states,output", help="the steps a candidate applies to")
    p.add_argument("--isolate", action="store_true", help="each candidate in its own process")
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    args = p.parse_args()
    if args.isolate and len(args.configs.split(";")) > 1:
        for cfg in args.configs.split(";"):
            argv = [a for a in sys.argv[1:] if a != "--isolate"]
            i = argv.index("--configs") if "--configs" in argv else None
            argv = (argv[:i] + argv[i + 2:]) if i is not None else argv
            subprocess.run([sys.executable, __file__, *argv, "--configs", cfg], check=False)
        return
    op = attngen.load(SPECS / f"{args.spec}.yaml")
    module = kernels_for(op)
    extras = {e: True for e in ([EXTRAS[op.spec.decay]] if op.spec.decay in EXTRAS else [])}
    if op.spec.update == "delta":
        extras["beta"] = True
    t = make(args.B, args.T, args.H, args.D, torch.bfloat16, False, **extras)
    run = lambda: op(**t)[0]  # noqa: E731
    ref = run().clone()
    launch, steps = module.chunked_launch, set(args.steps.split(","))
    base = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
    print(f"{args.spec} B{args.B} T{args.T} H{args.H} D{args.D} bf16 fwd: default {base:.3f} ms")
    for cfg in args.configs.split(";"):
        bv, nw = (int(x) for x in cfg.split(","))
        module.chunked_launch = lambda step, *a, bv=bv, nw=nw: (bv, nw) if step in steps else launch(step, *a)
        print(f"  steps {args.steps}:", end="")
        try:
            err = rel(run(), ref)
            ms = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
            kernels = ", ".join(f"{k.split('_kernel')[0].replace('chunked_', '')} {us:.0f}"
                                for k, us in profile(run, False, [])[:4])
            print(f"  BV {bv:3d} warps {nw}: {ms:.3f} ms rel diff {err:.1e}  ({kernels} us)", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  BV {bv:3d} warps {nw}: failed {type(e).__name__}: {str(e)[:80]}", flush=True)
        finally:
            module.chunked_launch = launch


if __name__ == "__main__":
    main()
