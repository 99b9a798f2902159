"""Numerics at length and at extreme decays, in float32 (DESIGN.md §7): long sequences through
the chunked form (and the parallel form at T = 512) with strong decays (log decay down to
-20 per token: cumulative log decays near -640 inside a 64-token chunk and -4e4 over the
sequence, so any exp(-cumsum) overflows) and with no decay at all (g = 0: the state only
grows). Results must be finite and within float32 tolerance of the float64 interpreter.

The interpreter is a token loop; it runs once per case (float64 oracle plus the float32 run
that sets the tolerance) and every form variant of that case is held to it.
"""
from __future__ import annotations

from functools import cache

import pytest
import torch

import attngen
from attngen.reference import reference
from attngen.testing import LOWP_FACTOR, Shape, compare, outputs_and_grads, random_inputs, rel_error, tolerance

from specs import SHIPPED

# additive and delta rules, each with a scalar and a vector decay
SPECS = {name: SHIPPED[name] for name in ("mamba2", "gla", "gated_deltanet", "kda")}
DECAYS = ("strong", "zero")


def make_inputs(name: str, decay: str, T: int) -> dict:
    op = attngen.load(SPECS[name])
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=T, heads=1, head_dim=16, value_dim=16), seed=17)
    gen = torch.Generator().manual_seed(23)
    g = inputs["g"]
    strong = -20.0 * torch.rand(g.shape, generator=gen, dtype=g.dtype)
    inputs["g"] = strong if decay == "strong" else torch.zeros_like(g)
    return inputs


@cache
def oracle(name: str, decay: str, T: int, with_grads: bool) -> tuple[dict, dict, dict]:
    """(inputs, float64 interpreter results, float32 interpreter results), computed once."""
    spec = attngen.load(SPECS[name]).spec
    inputs = make_inputs(name, decay, T)
    ref = outputs_and_grads(lambda **kw: reference(spec, **kw), spec, inputs, with_grads)
    low_inputs = {n: (t.float() if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    low = outputs_and_grads(lambda **kw: reference(spec, **kw, dtype=torch.float32), spec, low_inputs, with_grads)
    return inputs, ref, low


def check(name: str, decay: str, T: int, variants, with_grads: bool = False) -> None:
    op = attngen.load(SPECS[name])
    inputs, ref, low = oracle(name, decay, T, with_grads)
    run_inputs = {n: (t.float() if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    for r in ref.values():
        assert torch.isfinite(r).all(), "the float64 interpreter itself is not finite"
    failures = []
    for form, chunk in variants:
        def fn(form=form, chunk=chunk, **kw):
            return op(**kw, form=form, chunk_size=chunk)
        got = outputs_and_grads(fn, op.spec, run_inputs, with_grads)
        assert got["o"].dtype == torch.float32 and got["final_state"].dtype == torch.float32
        for key, want in ref.items():
            if not torch.isfinite(got[key]).all():
                failures.append(f"{form}(chunk={chunk}) {key}: not finite")
                continue
            err, tol = rel_error(got[key], want), tolerance(torch.float32, rel_error(low[key], want))
            if not err <= tol:
                failures.append(f"{form}(chunk={chunk}) {key}: error {err:.3g} > tolerance {tol:.3g}")
    assert not failures, f"{name}, {decay} decay, T = {T}:\n" + "\n".join(failures)


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("name", SPECS)
def test_long_sequence_chunked_float32(name, decay):
    check(name, decay, 4096, [("chunked", c) for c in (16, 32, 64)])


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("name", SPECS)
def test_parallel_at_512_float32(name, decay):
    check(name, decay, 512, [("parallel", None), ("chunked", 64)])


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("name", SPECS)
def test_gradients_at_extreme_decays_float32(name, decay):
    """Backward through the same extremes, on a shorter sequence (the interpreter's autograd
    is a token loop): three chunks of 64, the last one padded."""
    check(name, decay, 150, [("chunked", 64), ("chunked", 16), ("parallel", None)], with_grads=True)


# --------------------------------------------------------------------------- resets

# A gate of exactly zero (g = -inf) resets the state: every form must give what the interpreter
# gives (the recurrence with exp(-inf) = 0), forward and backward. Resets at a sequence's first
# token, two in a row, at the first token of the second packed sequence and inside a later
# chunk; a vector decay resets two of its channels; a constant decay resets all of head 1.
RESET_SPECS = ("mamba2", "retnet", "gla", "gated_deltanet", "kda", "forgetting_attention")
RESET_TOKENS = [0, 7, 8, 13, 21]
RESET_SHAPES = {
    "batch": Shape(batch=2, q_len=40, heads=2, head_dim=4, value_dim=3),
    "packed": Shape(batch=1, q_len=40, heads=2, head_dim=4, value_dim=3, cu_seqlens=(0, 13, 40)),
}


def with_resets(spec, inputs: dict) -> tuple[dict, tuple]:
    """inputs with resets in g, and the index of the reset entries of g."""
    g = inputs["g"].clone()
    if spec.decay == "constant":
        where = (1,)
    elif spec.decay == "vector":
        where = (slice(None), RESET_TOKENS, slice(None), slice(0, 2))
    else:
        where = (slice(None), RESET_TOKENS)
    g[where] = float("-inf")
    return dict(inputs, g=g), where


def check_resets(name: str, shape: Shape, dtype: torch.dtype) -> None:
    """Every form against the interpreter (outputs, states, gradients); the gradient at a reset
    gate is 0 (that of exp at -inf): exactly so in the interpreter."""
    op = attngen.load(SHIPPED[name])
    inputs, where = with_resets(op.spec, random_inputs(op.spec, shape, seed=2))
    ref = outputs_and_grads(lambda **kw: reference(op.spec, **kw), op.spec, inputs, with_grads=True)
    assert (ref["dg"][where] == 0).all()
    failures = []
    for form in op.plan.forms:
        chunk = 16 if form.name == "chunked" else None
        rows = compare(op.spec, lambda **kw: op(**kw, form=form.name, chunk_size=chunk), inputs, dtype)
        failures += [f"{form.name}: {n} error {e:.3g} > tolerance {t:.3g}" for n, e, t in rows if not e <= t]
    assert not failures, f"{name} with resets, {shape}:\n" + "\n".join(failures)


@pytest.mark.parametrize("shape", RESET_SHAPES.values(), ids=RESET_SHAPES.keys())
@pytest.mark.parametrize("name", RESET_SPECS)
def test_resets_torch(name, shape, monkeypatch):
    monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
    check_resets(name, shape, torch.float64)


@pytest.mark.parametrize("name", RESET_SPECS)
def test_resets_kernels(name, triton_backend):
    check_resets(name, RESET_SHAPES["packed"], torch.float32)


@pytest.mark.parametrize("cu_seqlens", [None, (0, 90, 200, 300)], ids=["batch", "packed"])
@pytest.mark.parametrize("strength", [1e1, 1e2])
def test_forgetting_attention_kernel_strong_gates(strength, cu_seqlens, triton_backend, monkeypatch):
    """The decay bias of the softmax kernel stays as accurate as in plain PyTorch (the PyTorch
    form in float32) under strong gates."""
    op = attngen.load(SHIPPED["forgetting_attention"])
    shape = Shape(batch=1, q_len=300, heads=1, head_dim=16, value_dim=16, cu_seqlens=cu_seqlens)
    inputs = random_inputs(op.spec, shape, seed=4)
    gen = torch.Generator().manual_seed(5)
    inputs["g"] = -strength * torch.rand(inputs["g"].shape, generator=gen, dtype=torch.float64)
    want = reference(op.spec, **inputs)
    low = {n: (t.float() if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    err = rel_error(op(**low), want)
    monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
    plain = rel_error(op(**low), want)
    assert err <= LOWP_FACTOR * plain, f"error {err:.3g}, the PyTorch form's {plain:.3g}"
