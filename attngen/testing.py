"""Inputs and comparisons shared by the tests and `attngen check`.

Tolerances follow DESIGN.md §7: an implementation in a low precision is judged against the
float64 oracle relative to the error of the same computation done in that precision in
plain PyTorch (the interpreter run in that dtype), never by a fixed loose bound.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .reference import reference
from .spec import Spec

# float64 implementations differ from the float64 oracle only by rounding order.
FLOAT64_RTOL = 1e-9
# A low-precision implementation may be this many times worse than plain PyTorch in the same
# precision, plus a floor at that precision's unit roundoff (for results plain PyTorch gets exact).
LOWP_FACTOR = 4.0
LOWP_FLOOR = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int = 2
    q_len: int = 33
    heads: int = 2
    head_dim: int = 8
    value_dim: int = 6
    k_len: int | None = None              # softmax only; defaults to q_len
    kv_heads: int | None = None           # softmax only: key / value heads (dividing heads); defaults to heads
    cu_seqlens: tuple[int, ...] | None = None


def random_inputs(spec: Spec, shape: Shape, dtype=torch.float64, seed: int = 0, initial_state: bool = True,
                  device="cpu", decay_strength: float = 1.0) -> dict:
    """Random legal inputs of a spec (never zeros). g is a log decay in (-inf, 0)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    B, T, H, K, V = shape.batch, shape.q_len, shape.heads, shape.head_dim, shape.value_dim
    Tk = shape.k_len or T
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    args: dict = {}
    if spec.is_linear:
        args.update(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, H, V))
        g_shape = {"none": None, "constant": (H,), "scalar": (B, T, H), "vector": (B, T, H, K)}[spec.decay]
    else:
        Hkv = shape.kv_heads or H
        args.update(q=rnd(B, T, H, K), k=rnd(B, Tk, Hkv, K), v=rnd(B, Tk, Hkv, V))
        g_shape = (B, Tk, H) if spec.decay == "scalar" else None
    if g_shape is not None:
        # log(sigmoid(x)) spans mild to strong decays; decay_strength scales it.
        args["g"] = torch.nn.functional.logsigmoid(rnd(*g_shape) + 2.0) * decay_strength
    if spec.is_linear and spec.update == "delta":
        args["beta"] = torch.sigmoid(rnd(B, T, H))
    if shape.cu_seqlens is not None:
        args["cu_seqlens"] = torch.tensor(shape.cu_seqlens, dtype=torch.int64)
    if spec.is_linear and initial_state:
        N = B if shape.cu_seqlens is None else len(shape.cu_seqlens) - 1
        F = spec.feature_dim(K)
        Vs = V + 1 if spec.normalize == "sum" else V
        s0 = rnd(N, H, F, Vs) * 0.1
        args["initial_state"] = s0.abs() if spec.normalize == "sum" else s0
    out = {}
    for name, t in args.items():
        t = t.to(device)
        out[name] = t.to(dtype) if t.is_floating_point() and name in ("q", "k", "v") else t
    return out


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; inf if a has a NaN or inf."""
    a, b = a.detach().to(torch.float64).cpu(), b.detach().to(torch.float64).cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def tolerance(dtype: torch.dtype, lowp_error: float | None) -> float:
    """The relative error allowed to an implementation computing in `dtype`: LOWP_FACTOR times the
    error of the same computation in plain low-precision PyTorch, at least the dtype's floor. Where
    that computation breaks down (inf or NaN: fp16 overflow), the floor alone."""
    if dtype == torch.float64:
        return FLOAT64_RTOL
    if lowp_error is None or not math.isfinite(lowp_error):
        lowp_error = 0.0
    return max(LOWP_FACTOR * lowp_error, LOWP_FLOOR[dtype])


def outputs_and_grads(fn, spec: Spec, inputs: dict, with_grads: bool, seed: int = 1, lse: bool = False) -> dict:
    """Run fn(**inputs) (the op's or the oracle's signature), and with_grads the gradients of a
    random projection of o (and of the final state; with lse, of softmax's log-sum-exp, asked
    for by return_lse=True) wrt every floating input."""
    inputs = {n: (t.detach().clone().requires_grad_(with_grads) if t.is_floating_point() else t)
              for n, t in inputs.items()}
    if spec.is_linear:
        o, s = fn(**inputs, output_final_state=True)
        outs = {"o": o, "final_state": s}
    elif lse:
        outs = dict(zip(("o", "lse"), fn(**inputs, return_lse=True)))
    else:
        outs = {"o": fn(**inputs)}
    result = {n: t.detach() for n, t in outs.items()}
    if with_grads:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        loss = sum((t * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t)).sum()
                   for t in outs.values())
        names = [n for n, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = torch.autograd.grad(loss, [inputs[n] for n in names], allow_unused=True)
        for n, gr in zip(names, grads):
            result["d" + n] = gr if gr is not None else torch.zeros_like(inputs[n])
    return result


def compare(spec: Spec, op_fn, inputs: dict, dtype: torch.dtype, with_grads: bool = True,
            device: torch.device | str | None = None, lse: bool = False) -> list[tuple[str, float, float]]:
    """(name, error, tolerance) for every output and gradient of op_fn on inputs in `dtype`,
    against the float64 oracle. Softmax/linear alike; lse: softmax's log-sum-exp too, and the
    gradients of a loss on it. The oracles run where the inputs are; op_fn runs on `device`
    (default: there too), e.g. CPU oracles for GPU kernels."""
    oracle = lambda **kw: reference(spec, **kw)
    ref = outputs_and_grads(oracle, spec, inputs, with_grads, lse=lse)
    lowp = None
    if dtype != torch.float64:
        low_inputs = {n: (t.to(dtype) if n in ("q", "k", "v") else t) for n, t in inputs.items()}
        lowp = outputs_and_grads(lambda **kw: reference(spec, **kw, dtype=dtype), spec, low_inputs, with_grads,
                                 lse=lse)
    run_inputs = {n: (t.to(dtype) if n in ("q", "k", "v") else t).to(device or t.device) for n, t in inputs.items()}
    got = outputs_and_grads(op_fn, spec, run_inputs, with_grads, lse=lse)
    rows = []
    for name, r in ref.items():
        err = rel_error(got[name], r)
        tol = tolerance(dtype, rel_error(lowp[name], r) if lowp is not None else None)
        rows.append((name, err, tol))
    return rows
