"""Attention residuals (examples/hybrid_lm.py's DepthMix: a softmax spec over the depth axis, run by
attngen) against flash-linear-attention's attnres ops: the same inputs, the outputs and gradients
compared, and on a GPU both timed.

    python bench/attnres.py [--tokens 8192] [--depth 8] [--dim 128] [--dtype bfloat16] [--device cuda]

Per token, L earlier blocks' outputs v_l [D] are mixed by p = softmax_l(scale * q . RMSNorm(v_l)),
o = sum_l p_l v_l, one learned query q [D] per block (fla: naive_attnres, the PyTorch reference,
and fused_attnres, its Triton kernel on CUDA; both with attngen's scale 1 / sqrt(D) and
nn.RMSNorm's eps). Needs fla (its wheel; einops); on a CPU it checks attngen against fla's
reference at the given sizes (use small ones: the kernels run in Triton's interpreter, or set
ATTNGEN_BACKEND=torch for the PyTorch forms) and times nothing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import hybrid_lm  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--depth", type=int, default=8, help="blocks mixed (the residual sources)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32", "float64"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    try:
        from fla.ops.attnres import fused_attnres, naive_attnres
    except ImportError as e:
        print(f"bench/attnres.py: flash-linear-attention is not installed ({e}): nothing to compare against")
        return 1
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    N, L, D = args.tokens, args.depth, args.dim
    torch.manual_seed(0)
    # the block's parameters in the inputs' dtype, as in a model cast to it
    mix = hybrid_lm.DepthMix(D).to(device, dtype)
    with torch.no_grad():
        mix.query.normal_()
        mix.norm.weight.uniform_(0.5, 1.5)
    stack = torch.randn(N, 1, L, D, device=device, dtype=dtype).requires_grad_(True)
    query, weight = mix.query, mix.norm.weight
    eps = torch.finfo(dtype).eps   # nn.RMSNorm(eps=None)

    def ours():
        return mix(stack)

    def theirs(fn):
        residuals = list(stack.unbind(2))
        return fn(query, residuals, weight, rms_eps=eps, scale=D ** -0.5)

    do = torch.randn(N, 1, D, device=device, dtype=dtype)
    leaves = (stack, query, weight)

    def grads(fn):
        o = fn()
        gs = torch.autograd.grad(o, leaves, do)
        return [o.detach()] + list(gs)

    names = ("o", "d residuals", "d query", "d rms weight")
    ref = grads(lambda: theirs(naive_attnres))
    rows = [("attngen (DepthMix)", grads(ours))]
    if device.type == "cuda":
        rows.append(("fla fused_attnres", grads(lambda: theirs(fused_attnres))))
    print(f"attention residuals: {N} tokens, {L} blocks, D {D}, {args.dtype} on {device}; "
          f"relative difference from fla naive_attnres:")
    for label, got in rows:
        diffs = [float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)) for a, b in zip(got, ref)]
        print(f"  {label:<20s} " + "  ".join(f"{n} {d:.1e}" for n, d in zip(names, diffs)))
    if device.type != "cuda":
        return 0
    import triton
    print(f"{'implementation':<20s} {'fwd ms':>8s} {'fwd+bwd ms':>11s}")
    for label, fn in (("attngen (DepthMix)", ours), ("fla fused_attnres", lambda: theirs(fused_attnres))):
        fwd = triton.testing.do_bench(lambda: fn(), warmup=25, rep=100, return_mode="median")
        train = triton.testing.do_bench(lambda: torch.autograd.grad(fn(), leaves, do), warmup=25, rep=100,
                                        return_mode="median")
        print(f"{label:<20s} {fwd:8.3f} {train:11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
