"""Inputs and comparisons shared by the tests and `attngen check`.

Tolerances follow DESIGN.md §7: an implementation in a low precision is judged against the
float64 oracle relative to the error of the same computation done in that precision in
plain PyTorch (the interpreter run in that dtype), never by a fixed loose bound.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

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
    value_heads: int | None = None        # linear only: value / state heads (a multiple of heads); defaults to heads
    cu_seqlens: tuple[int, ...] | None = None


def random_inputs(spec: Spec, shape: Shape, dtype=torch.float64, seed: int = 0, initial_state: bool = True,
                  device="cpu", decay_strength: float = 1.0) -> dict:
    """Random legal inputs of a spec (never zeros). g is a log decay in (-inf, 0)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    B, T, H, K, V = shape.batch, shape.q_len, shape.heads, shape.head_dim, shape.value_dim
    Tk = shape.k_len or T
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    args: dict = {}
    HV = shape.value_heads or H
    if spec.is_linear:
        # g, beta and the state are per value head
        args.update(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, HV, V))
        g_shape = {"none": None, "constant": (HV,), "scalar": (B, T, HV), "vector": (B, T, HV, K)}[spec.decay]
    else:
        Hkv = shape.kv_heads or H
        args.update(q=rnd(B, T, H, K), k=rnd(B, Tk, Hkv, K), v=rnd(B, Tk, Hkv, V))
        g_shape = (B, Tk, H) if spec.decay == "scalar" else None
    if g_shape is not None:
        # log(sigmoid(x)) spans mild to strong decays; decay_strength scales it.
        args["g"] = torch.nn.functional.logsigmoid(rnd(*g_shape) + 2.0) * decay_strength
    if spec.is_linear and spec.rule.takes_beta:
        args["beta"] = torch.sigmoid(rnd(B, T, HV))
    if shape.cu_seqlens is not None:
        args["cu_seqlens"] = torch.tensor(shape.cu_seqlens, dtype=torch.int64)
    if spec.is_linear and initial_state:
        N = B if shape.cu_seqlens is None else len(shape.cu_seqlens) - 1
        F = spec.feature_dim(K)
        Vs = V + 1 if spec.normalize == "sum" else V
        s0 = rnd(N, HV, F, Vs) * 0.1
        args["initial_state"] = s0.abs() if spec.normalize == "sum" else s0
    out = {}
    for name, t in args.items():
        t = t.to(device)
        out[name] = t.to(dtype) if t.is_floating_point() and name in ("q", "k", "v") else t
    return out


def vector_gates_across_span(shape: Shape, seed: int) -> torch.Tensor:
    """Vector log decays g [B, T, H, K] (float64) whose 64-token chunks fall on both sides of
    planner.DECAY_SPAN, by chunk index mod 4, in a third of the lanes (the others near 0): just inside
    it (DECAY_SPAN / 64 times 0.95 .. 0.99 per token: the output pass's pairs as one dot through exp(-G)
    near exp(DECAY_SPAN)); past it with its 16-token blocks inside (DECAY_SPAN / 32 per token); far past
    it (down to -50 per token); mild (down to -0.1)."""
    from .planner import DECAY_SPAN
    gen = torch.Generator().manual_seed(seed)
    size = (shape.batch, shape.q_len, shape.heads, shape.head_dim)
    lane = (torch.arange(shape.head_dim) % 3 == 1).expand(size)
    kind = (torch.arange(shape.q_len) // 64 % 4)[None, :, None, None].expand(size)
    depth = torch.rand(size, generator=gen, dtype=torch.float64)
    per_token = torch.stack([-DECAY_SPAN / 64 * (0.95 + 0.04 * depth), -DECAY_SPAN / 32 * (0.9 + 0.1 * depth),
                             -50.0 * depth, -0.1 * depth])
    return torch.where(lane, per_token.gather(0, kind[None]).squeeze(0), -1e-3 * depth)


def kernel_launch(op, inputs: dict, form: str | None = None, chunk_size: int | None = None) -> tuple[str, list[int]]:
    """(kernel form, launch ints) that the op's kernels take for a call on inputs (the generated
    module's `form` and `launch` arguments), for tests that call a module's launchers directly."""
    from .runtime import check_call, kernel_launch as launch_of
    call = check_call(op, inputs)
    return launch_of(op.spec, op.choose(call, form, chunk_size), call, inputs["q"].device, inputs["q"].dtype)


def force_launch(monkeypatch, **knobs) -> None:
    """From now on, every chunked call's launch (its table entry's or the planner's default) with these
    knobs set over it, then fitted to the call as the planner fits any launch."""
    from . import planner, tuning
    real = tuning._remembered

    def forced(spec, family, call, dtype, *rest):
        launch = dataclasses.replace(planner.ChunkedLaunch(*real(spec, family, call, dtype, *rest)), **knobs)
        return tuple(planner.fit_chunked(spec, tuning.Call(*call), dtype, launch).ints())

    monkeypatch.setattr(tuning, "_remembered", forced)


def spy_launches(monkeypatch, module, kernels) -> list:
    """Each launch of the generated module's `kernels` from now on, in order, as (kernel, grid,
    keyword arguments); the launches still run."""
    launches = []
    for kernel in kernels:
        real = getattr(module, kernel)

        class Spy:
            def __getitem__(self, grid, real=real, kernel=kernel):
                def launch(*args, **kwargs):
                    launches.append((kernel, grid, kwargs))
                    return real[grid](*args, **kwargs)
                return launch

        monkeypatch.setattr(module, kernel, Spy())
    return launches


def parse_shape(text: str) -> Shape:
    """B,T,H,K,V[,Tq[,H_kv]] -> a Shape: T the keys' length (and the queries' unless Tq is given:
    decode is Tq 1), H_kv the key / value heads (grouped-query softmax)."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) not in (5, 6, 7) or min(sizes) < 1:
        raise ValueError(f"--shapes: expected B,T,H,K,V[,Tq[,H_kv]] (positive integers), got {text!r}")
    B, T, H, K, V = sizes[:5]
    Tq = sizes[5] if len(sizes) > 5 else T
    Hkv = sizes[6] if len(sizes) > 6 else H
    if Tq > T:
        raise ValueError(f"--shapes: Tq = {Tq} must be at most T = {T} (queries align to the end of the keys), "
                         f"in {text!r}")
    if H % Hkv:
        raise ValueError(f"--shapes: H_kv = {Hkv} must divide H = {H}, in {text!r}")
    return Shape(batch=B, q_len=Tq, heads=H, head_dim=K, value_dim=V, k_len=T if T != Tq else None,
                 kv_heads=Hkv if Hkv != H else None)


def format_shape(shape: Shape) -> str:
    """parse_shape's inverse."""
    T = shape.k_len or shape.q_len
    text = f"{shape.batch},{T},{shape.heads},{shape.head_dim},{shape.value_dim}"
    if shape.q_len != T or shape.kv_heads:
        text += f",{shape.q_len}"
    return text + (f",{shape.kv_heads}" if shape.kv_heads else "")


def bench_inputs(spec: Spec, shape: Shape, dtype: torch.dtype, device, seed: int = 0,
                requires_grad: bool = False) -> dict:
    """Random inputs of a spec's op for timing (`attngen bench`, `attngen tune`), drawn on the device
    (long sequences need no host copy, unlike random_inputs): q, k, v standard normal in dtype; log
    decays logsigmoid(x + 3) (mild, as trained gates are) in float32, a constant one from -0.01 to
    -0.2 over the heads; beta sigmoid(x) in dtype. requires_grad: every input but a constant decay,
    which stays fixed (RetNet's per-head decays; fla's g_gamma has no gradient either), so that its
    backward computes no decay gradient (chunked_bwd's decay_grad)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    B, Tq, H, K, V = shape.batch, shape.q_len, shape.heads, shape.head_dim, shape.value_dim
    T, Hkv = shape.k_len or Tq, shape.kv_heads or H
    t = {"q": rnd(B, Tq, H, K).to(dtype), "k": rnd(B, T, Hkv, K).to(dtype), "v": rnd(B, T, Hkv, V).to(dtype)}
    if spec.decay == "scalar":
        t["g"] = F.logsigmoid(rnd(B, T, H) + 3)
    elif spec.decay == "vector":
        t["g"] = F.logsigmoid(rnd(B, T, H, K) + 3)
    elif spec.decay == "constant":
        t["g"] = -torch.linspace(0.01, 0.2, H, device=device)
    if spec.is_linear and spec.rule.takes_beta:
        t["beta"] = torch.sigmoid(rnd(B, T, H)).to(dtype)
    for name, x in t.items():
        x.requires_grad_(requires_grad and not (name == "g" and spec.decay == "constant"))
    return t


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
            device: torch.device | str | None = None, lse: bool = False,
            outputs: dict | None = None) -> list[tuple[str, float, float]]:
    """(name, error, tolerance) for every output and gradient of op_fn on inputs in `dtype`,
    against the float64 oracle. Softmax/linear alike; lse: softmax's log-sum-exp too, and the
    gradients of a loss on it. The oracles run where the inputs are; op_fn runs on `device`
    (default: there too), e.g. CPU oracles for GPU kernels. outputs: a dict that receives op_fn's
    outputs and gradients (outputs_and_grads'), for a caller that checks more of them."""
    oracle = lambda **kw: reference(spec, **kw)
    ref = outputs_and_grads(oracle, spec, inputs, with_grads, lse=lse)
    lowp = None
    if dtype != torch.float64:
        low_inputs = {n: (t.to(dtype) if n in ("q", "k", "v") else t) for n, t in inputs.items()}
        lowp = outputs_and_grads(lambda **kw: reference(spec, **kw, dtype=dtype), spec, low_inputs, with_grads,
                                 lse=lse)
    run_inputs = {n: (t.to(dtype) if n in ("q", "k", "v") else t).to(device or t.device) for n, t in inputs.items()}
    got = outputs_and_grads(op_fn, spec, run_inputs, with_grads, lse=lse)
    if outputs is not None:
        outputs.update(got)
    rows = []
    for name, r in ref.items():
        err = rel_error(got[name], r)
        tol = tolerance(dtype, rel_error(lowp[name], r) if lowp is not None else None)
        rows.append((name, err, tol))
    return rows
