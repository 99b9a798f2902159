"""Time the delta rule's UT step (chunked_ut_kernel) of several generated modules of one spec side by
side (GPU): each module's kernel on the same bf16 inputs, its outputs against the first module's.

    python bench/probe_ut.py MODULE.py [MODULE.py ...] [--B 4 --T 8192 --H 16 --D 128]
        [--chunks 64,32] [--warps 2,4] [--maxnreg 255] [--vector] [--wu-warps 0,4]

A module is a file `attngen compile` wrote (generated/<spec>.py) or a variant of one: this is how a
change to the step is measured against main before it goes into the template (keep main's module
aside, e.g. `git show HEAD:generated/gated_deltanet.py > /tmp/main.py`). Only the module's kernels
are loaded (its source up to the op's section). The inputs are drawn as the benchmarks draw them
(keys l2-normalised by the kernel, β, a decay per token or with --vector per key channel). With
--wu-warps N > 0 (a list, like --warps), a module whose chunked_ut_kernel takes FUSED_WU runs the
step split in two, as the op's launch knob wu_warps does (the inverse, then chunked_wu_kernel's W,
U0 and keys at N warps); 0 (the default) runs it as one kernel. A row per chunk, module and warps: the median time (do_bench, us) and the largest
relative difference of W, U0 and the state keys from the first module's at that chunk. --maxnreg
as the op's launch sets it (planner.MAXNREG): the registers change which variant is faster.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

OP_SECTION = "\n# ---------------------------------------------------------------------------- the op\n"
MODULES: list = []

def load(path: str):
    """The kernels and launch helpers of a generated module: its source up to the op's section (which
    registers the torch op, once per name and process), written where Triton's jit reads it back."""
    if not Path(path).is_file():
        raise SystemExit(f"probe_ut: module {path!r} is not a file (a generated module, generated/<spec>.py)")
    src = Path(path).read_text()
    if OP_SECTION not in src or "def chunked_ut_kernel(" not in src:
        raise SystemExit(f"probe_ut: {path} is not a generated module of a delta rule (no chunked_ut_kernel "
                         f"before its op section)")
    kernels = Path(tempfile.mkdtemp()) / f"{Path(path).stem}.py"
    kernels.write_text(src[:src.index(OP_SECTION)])
    spec = importlib.util.spec_from_file_location(f"probe_ut_{Path(path).stem}_{len(MODULES)}", kernels)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.allocates_ai_in_pass_dtype = "ai = torch.empty(B, T, H, chunk, **tiles)" in src
    MODULES.append(mod)
    return mod


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def ut(mod, k, v, g, beta, chunk: int, warps: int, wu_warps: int = 0, maxnreg: int | None = None):
    """One launch of mod's chunked_ut_kernel as mod's chunked_states makes it -> (w, u, kr)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    n_slots = B * triton.cdiv(T, chunk)
    tiles = dict(device=k.device, dtype=mod.chunked_pass_dtype(k.dtype))
    # the module's own dtype of (I + A)^-1, as its chunked_states allocates it
    ai_dtype = tiles["dtype"] if mod.allocates_ai_in_pass_dtype else torch.float32
    ai = torch.empty(B, T, H, chunk, device=k.device, dtype=ai_dtype)
    w, kr, u = (torch.empty(B, T, H, K, **tiles), torch.empty(B, T, H, K, **tiles), torch.empty(B, T, H, V, **tiles))
    gc = torch.empty(n_slots, H, *g.shape[3:], device=k.device, dtype=torch.float32) if g is not None else None
    BK = max(16, triton.next_power_of_2(K))

    args = (k, v, g, beta, None, ai, w, kr, u, gc, None, None, None, T, H, K, V, K, K ** -0.25, K ** -0.5)
    meta = dict(BT=chunk, BK=BK, BF=BK, BV=min(64, V), IS_VARLEN=False, QK_GROUP=1,
                DOT_PRECISION=mod.chunked_dot_precision(k.dtype), **({"maxnreg": maxnreg} if maxnreg else {}))
    if "G_DTYPE" in mod.chunked_ut_kernel.arg_names:
        # the dtype of its cumulative log decays (a module from before it sums them in float64)
        meta["G_DTYPE"] = mod.chunked_decay_dtype(k.dtype)
    # a module from before the split (no FUSED_WU) always runs the step as one kernel
    splits = "FUSED_WU" in mod.chunked_ut_kernel.arg_names
    split = splits and wu_warps > 0
    ut_meta = dict(meta, FUSED_WU=not split) if splits else meta

    def launch():
        mod.chunked_ut_kernel[(n_slots * H,)](*args, **ut_meta, num_warps=warps)
        if split:
            # the step split in two: the inverse, then W, U0 and the keys
            mod.chunked_wu_kernel[(n_slots * H,)](*args, **meta, num_warps=wu_warps)
    return launch, (w, u, kr)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("modules", nargs="+")
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--chunks", default="64,32")
    p.add_argument("--warps", default="2")
    p.add_argument("--wu-warps", default="0", help="comma-separated warps of W, U0 and the keys as a kernel of "
                   "their own (0: in the UT step's kernel)")
    p.add_argument("--maxnreg", type=int, default=None, help="registers per thread (as the op's launch sets them)")
    p.add_argument("--vector", action="store_true", help="a decay per key channel (KDA), else one per token")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("probe_ut: no CUDA GPU on this machine")
        return 1
    for name in ("chunks", "warps", "wu_warps"):
        if not all(x.isdigit() for x in getattr(args, name).split(",")):
            p.error(f"--{name.replace('_', '-')}: expected comma-separated integers, got {getattr(args, name)!r}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    B, T, H, D = args.B, args.T, args.H, args.D
    k, v = rnd(B, T, H, D).bfloat16(), rnd(B, T, H, D).bfloat16()
    g = F.logsigmoid(rnd(B, T, H, D) + 3) if args.vector else F.logsigmoid(rnd(B, T, H) + 3)
    beta = torch.sigmoid(rnd(B, T, H)).bfloat16()
    mods = [load(m) for m in args.modules]
    print(f"chunked_ut_kernel at B{B} T{T} H{H} K=V={D} bf16 (us, do_bench median; diff: largest relative "
          f"difference of W, U0, keys from the first module)")
    for chunk in map(int, args.chunks.split(",")):
        ref = None
        for path, mod in zip(args.modules, mods):
            for warps, wu in itertools.product(map(int, args.warps.split(",")), map(int, args.wu_warps.split(","))):
                if wu and "FUSED_WU" not in mod.chunked_ut_kernel.arg_names:
                    continue  # a module from before the split
                try:
                    launch, outs = ut(mod, k, v, g, beta, chunk, warps, wu, args.maxnreg)
                    launch()
                    torch.cuda.synchronize()
                    us = 1e3 * triton.testing.do_bench(launch, warmup=25, rep=100, return_mode="median")
                    outs = [o.float().clone() for o in outs]
                    diff = "-" if ref is None else f"{max(rel(a, b) for a, b in zip(outs, ref)):.1e}"
                    ref = ref or outs
                    print(f"chunk {chunk:2d} warps {warps} wu {wu}  {us:8.1f} us  diff {diff:8s} {path}", flush=True)
                except Exception as e:  # noqa: BLE001 -- a variant that fails is a row saying why
                    why = f"{type(e).__name__}: {str(e)[:160]}"
                    print(f"chunk {chunk:2d} warps {warps} wu {wu}  failed: {why}  {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
