"""Probe (GPU): does a causal FlashAttention forward in Triton gain from tensor-descriptor (TMA) loads on
this GPU? A minimal forward over [B, T, H, D] inputs, the same math as the generated softmax forward
(scores in log2 units, full tiles unmasked, the diagonal tiles masked), its key and value tiles loaded
either by pointers (as the generated kernel does) or through host-built tensor descriptors of the
[B * T, H * D] view; timed per launch configuration against SDPA, outputs checked against SDPA.

    python bench/probe_softmax_tma.py [--B 4] [--T 8192] [--H 16] [--D 128] [--configs "BM,BN,warps,stages;..."]

On a machine without a GPU, --check runs a small shape through the Triton interpreter
(TRITON_INTERPRET=1) against a float64 reference, both variants.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _tiles(b_acc, b_l, b_m, b_q, o_pos, k, v, k_desc, v_desc, row0, col0, lo, hi, qk_scale,
           HD: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    o_d = tl.arange(0, D)
    for i_s in range(lo, hi, BN):
        o_n = i_s + tl.arange(0, BN)
        if TMA:
            b_k = k_desc.load([row0 + i_s, col0])
            b_v = v_desc.load([row0 + i_s, col0])
            b_s = tl.dot(b_q, tl.trans(b_k)) * qk_scale
        else:
            b_kt = tl.load(k + (row0 + o_n)[None, :] * HD + col0 + o_d[:, None])
            b_v = tl.load(v + (row0 + o_n)[:, None] * HD + col0 + o_d[None, :])
            b_s = tl.dot(b_q, b_kt) * qk_scale
        if MASKED:
            b_s = tl.where(o_n[None, :] <= o_pos[:, None], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_alpha = tl.exp2(b_m - b_m_new)
        b_p = tl.exp2(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
        b_m = b_m_new
    return b_acc, b_l, b_m


@triton.jit
def probe_fwd_kernel(q, k, v, o, k_desc, v_desc, T, qk_scale, n_blocks,
                     H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TMA: tl.constexpr):
    i_pid = tl.program_id(0)
    i_bh = i_pid // n_blocks
    i_m = n_blocks - 1 - i_pid % n_blocks
    i_b, i_h = i_bh // H, i_bh % H
    HD: tl.constexpr = H * D
    row0 = i_b * T
    col0 = i_h * D
    o_m = i_m * BM + tl.arange(0, BM)
    o_d = tl.arange(0, D)
    b_q = tl.load(q + (row0 + o_m).to(tl.int64)[:, None] * HD + col0 + o_d[None, :])
    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, D], dtype=tl.float32)
    i_edge = (i_m * BM + 1) // BN * BN
    b_acc, b_l, b_m = _tiles(b_acc, b_l, b_m, b_q, o_m, k, v, k_desc, v_desc, row0, col0, 0, i_edge, qk_scale,
                             HD, D, BN, False, TMA)
    b_acc, b_l, b_m = _tiles(b_acc, b_l, b_m, b_q, o_m, k, v, k_desc, v_desc, row0, col0, i_edge, i_m * BM + BM,
                             qk_scale, HD, D, BN, True, TMA)
    b_o = b_acc / b_l[:, None]
    tl.store(o + (row0 + o_m).to(tl.int64)[:, None] * HD + col0 + o_d[None, :], b_o.to(o.dtype.element_ty))


def probe_fwd(q, k, v, BM, BN, warps, stages, tma):
    B, T, H, D = q.shape
    o = torch.empty_like(q)
    k2, v2 = k.view(B * T, H * D), v.view(B * T, H * D)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [BN, D])
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [BN, D])
    n_blocks = T // BM
    probe_fwd_kernel[(B * H * n_blocks,)](q, k, v, o, k_desc, v_desc, T, D ** -0.5 * 1.4426950408889634, n_blocks,
                                          H=H, D=D, BM=BM, BN=BN, TMA=tma, num_warps=warps, num_stages=stages)
    return o


def reference(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--configs", default="64,64,4,3;128,64,8,3;128,128,8,2;128,128,8,3;128,64,4,3;64,128,4,2")
    ap.add_argument("--check", action="store_true", help="a small shape through the interpreter (CPU)")
    args = ap.parse_args()
    if args.check:
        assert os.environ.get("TRITON_INTERPRET") == "1", "--check runs under TRITON_INTERPRET=1"
        torch.manual_seed(0)
        B, T, H, D = 2, 128, 2, 32
        q, k, v = (torch.randn(B, T, H, D, dtype=torch.float32) for _ in range(3))
        ref = reference(q.double(), k.double(), v.double())
        for tma in (False, True):
            out = probe_fwd(q, k, v, 32, 16, 4, 1, tma)
            print("tma" if tma else "ptr", "max err", (out.double() - ref).abs().max().item())
        return
    from triton.testing import do_bench
    torch.manual_seed(0)
    B, T, H, D = args.B, args.T, args.H, args.D
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    ref = reference(q, k, v)
    flops = 4 * B * H * T * T * D / 2
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    ms = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
    print(f"SDPA (contiguous [B, H, T, D])      {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    for cfg in args.configs.split(";"):
        BM, BN, warps, stages = (int(x) for x in cfg.split(","))
        for tma in (False, True):
            name = f"{'tma' if tma else 'ptr'} BM{BM} BN{BN} w{warps} s{stages}"
            try:
                out = probe_fwd(q, k, v, BM, BN, warps, stages, tma)
                err = (out.float() - ref.float()).abs().max().item()
                ms = do_bench(lambda: probe_fwd(q, k, v, BM, BN, warps, stages, tma))
                print(f"{name:34s} {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s  max err {err:.1e}", flush=True)
            except Exception as e:  # a config that does not compile or fit is reported, not fatal
                print(f"{name:34s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
