"""Which 16-bit dots Triton compiles wrong (GPU; a seconds-long check): C = A @ B for A [M, Kd] given as
the kernels give it, against torch in float32.

    python bench/probe_dot.py [--M 32,64] [--Kd 32,64] [--N 32,64,128] [--warps 2,4,8] [--dtype bfloat16]

A is loaded row by row ("rows"), loaded through transposed pointers from A^T's rows ("t-load",
how chunked_bwd_wy_kernel loads T^T and chunked_bwd_dk_kernel dO^T), or loaded as A^T and
transposed in registers ("trans"). At M = 64 and four warps or more the dots go to Hopper's wgmma:
where the delta rules' 64-token backward went wrong (bench/results/2026-12-02_bwd_wy_scratch_h200.txt).
Under TRITON_INTERPRET=1 it runs on the CPU (every row right: the interpreter is the reference).
"""
from __future__ import annotations

import argparse
import itertools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def dot_kernel(a, at, b, c, MODE: tl.constexpr, M: tl.constexpr, KD: tl.constexpr, N: tl.constexpr,
               EMULATED: tl.constexpr):
    o_m, o_k, o_n = tl.arange(0, M), tl.arange(0, KD), tl.arange(0, N)
    if MODE == 0:
        b_a = tl.load(a + o_m[:, None] * KD + o_k[None, :])
    elif MODE == 1:
        b_a = tl.load(at + o_k[None, :] * M + o_m[:, None])
    else:
        b_a = tl.trans(tl.load(at + o_k[:, None] * M + o_m[None, :]))
    b_b = tl.load(b + o_k[:, None] * N + o_n[None, :])
    if EMULATED:
        # the interpreter multiplies 16-bit operands as raw bits: float32 products of the same values
        c_ab = tl.dot(b_a.to(tl.float32), b_b.to(tl.float32), input_precision="ieee")
    else:
        c_ab = tl.dot(b_a, b_b)
    tl.store(c + o_m[:, None] * N + o_n[None, :], c_ab)


MODES = {"rows": 0, "t-load": 1, "trans": 2}


def main() -> int:
    p = argparse.ArgumentParser()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--M", type=ints, default=[32, 64])
    p.add_argument("--Kd", type=ints, default=[32, 64])
    p.add_argument("--N", type=ints, default=[32, 64, 128])
    p.add_argument("--warps", type=ints, default=[2, 4, 8])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = p.parse_args()
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    print(f"{'M':>3s} {'Kd':>3s} {'N':>4s} {'warps':>5s} " + " ".join(f"{m:>10s}" for m in MODES) + "   (max |C - A @ B| / max |A @ B|)")
    bad = 0
    for M, Kd, N, warps in itertools.product(args.M, args.Kd, args.N, args.warps):
        a = torch.randn(M, Kd, generator=gen).to(dtype)
        b = torch.randn(Kd, N, generator=gen).to(dtype)
        want = a.float() @ b.float()
        row = []
        for mode in MODES.values():
            c = torch.empty(M, N, dtype=torch.float32, device=device)
            dot_kernel[(1,)](a.to(device), a.t().contiguous().to(device), b.to(device), c, MODE=mode, M=M, KD=Kd, N=N,
                             EMULATED=device == "cpu", num_warps=warps)
            err = ((c.cpu() - want).abs().max() / want.abs().max()).item()
            bad += err > 1e-2
            row.append(f"{err:10.1e}")
        print(f"{M:3d} {Kd:3d} {N:4d} {warps:5d} " + " ".join(row), flush=True)
    print(f"{bad} wrong (relative error above 1e-2)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
