"""Metamorphic properties of the op (DESIGN.md §7), in float64: relations between calls that
hold exactly in exact arithmetic, so every pair must agree to float64 rounding."""
from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import attngen
from attngen.spec import NORM_EPS
from attngen.testing import Shape, outputs_and_grads, random_inputs, rel_error, tolerance

try:
    from specs import SHIPPED
    from strategies import legal_specs, shapes
except ImportError:  # tests/ imported as a package
    from tests.specs import SHIPPED
    from tests.strategies import legal_specs, shapes

TOL = tolerance(torch.float64, None)
SETTINGS = {"deadline": None, "derandomize": True, "print_blob": True,
            "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much,
                                      HealthCheck.data_too_large]}


def assert_close(got: dict, want: dict, what: str = "") -> None:
    """Every tensor of `want` (outputs, states, gradients) matches `got` to float64 rounding."""
    bad = []
    for name, w in want.items():
        if w is None and got[name] is None:
            continue
        err = rel_error(got[name], w)
        if not err <= TOL:
            bad.append(f"{name}: relative error {err:.3g} > {TOL:.3g}")
    assert not bad, f"{what}\n" + "\n".join(bad)


def run(op, inputs: dict, **kw) -> dict:
    """Outputs (and the final state) of one call, as a dict."""
    if op.spec.is_linear:
        o, s = op(**inputs, output_final_state=True, **kw)
        return {"o": o, "final_state": s}
    return {"o": op(**inputs, **kw)}


def grads(op, inputs: dict, **kw) -> dict:
    """Outputs, final state and the gradients of every floating input (attngen.testing)."""
    return outputs_and_grads(lambda **a: op(**a, **kw), op.spec, inputs, with_grads=True)


def time_slice(spec, inputs: dict, start: int, end: int) -> dict:
    """The inputs of tokens [start, end) (g of a constant decay is per head: kept)."""
    out = {}
    for name, t in inputs.items():
        if name in ("initial_state", "cu_seqlens") or (name == "g" and spec.decay == "constant"):
            out[name] = t
        else:
            out[name] = t[:, start:end]
    return out


def causal_linear(spec: dict) -> bool:
    return spec["mask"] == "causal"


def form_choices(op, chunks=(16,)):
    for form in op.plan.forms:
        if form.name == "chunked":
            for c in chunks:
                yield form.name, c
        else:
            yield form.name, None


# --------------------------------------------------------------------------- state passing

@settings(max_examples=40, **SETTINGS)
@given(spec=legal_specs("linear").filter(causal_linear), data=st.data())
def test_split_sequence_with_state_passing_equals_whole(spec, data):
    op = attngen.load(spec)
    case = data.draw(shapes(op.spec, varlen=False).filter(lambda c: c.shape.q_len >= 2), label="case")
    T = case.shape.q_len
    split = data.draw(st.integers(1, T - 1), label="split")
    inputs = random_inputs(op.spec, case.shape, seed=data.draw(st.integers(0, 999)),
                           initial_state=case.initial_state)
    for form, chunk in form_choices(op):
        whole = run(op, inputs, form=form, chunk_size=chunk)
        first = run(op, time_slice(op.spec, inputs, 0, split), form=form, chunk_size=chunk)
        second_in = dict(time_slice(op.spec, inputs, split, T), initial_state=first["final_state"])
        second = run(op, second_in, form=form, chunk_size=chunk)
        got = {"o": torch.cat([first["o"], second["o"]], 1), "final_state": second["final_state"]}
        assert_close(got, whole, f"{form} chunk={chunk}, split at {split} of {T}")


@settings(max_examples=25, **SETTINGS)
@given(spec=legal_specs("linear").filter(causal_linear), data=st.data())
def test_decode_token_by_token_equals_one_call(spec, data):
    """Decode: T calls with T = 1, each passing its final state to the next."""
    op = attngen.load(spec)
    case = data.draw(shapes(op.spec, varlen=False, max_len=33), label="case")
    T = case.shape.q_len
    inputs = random_inputs(op.spec, case.shape, seed=data.draw(st.integers(0, 999)),
                           initial_state=case.initial_state)
    whole = run(op, inputs)
    state, outs = inputs.get("initial_state"), []
    for t in range(T):
        step = dict(time_slice(op.spec, inputs, t, t + 1), initial_state=state)
        o, state = op(**step, output_final_state=True)
        outs.append(o)
    assert_close({"o": torch.cat(outs, 1), "final_state": state}, whole, f"decode of {T} tokens")


@pytest.mark.parametrize("name", ["softmax_causal", "sliding_window", "forgetting_attention"])
def test_softmax_decode_with_kv_cache_equals_one_call(name):
    """Softmax decode: query t alone (Tq = 1) against keys 0..t equals row t of one call."""
    spec = attngen.load_spec(SHIPPED[name]).to_dict()
    if "window" in spec:
        spec["window"] = 5
    op = attngen.load(spec)
    inputs = random_inputs(op.spec, Shape(batch=2, q_len=19, heads=2, head_dim=6, value_dim=5), seed=3)
    whole = op(**inputs)
    for t in range(19):
        step = {n: (x[:, t:t + 1] if n == "q" else x[:, : t + 1]) for n, x in inputs.items()}
        assert_close({"o": op(**step)}, {"o": whole[:, t:t + 1]}, f"{name} query {t}")


# --------------------------------------------------------------------------- forms and chunks

@settings(max_examples=30, **SETTINGS)
@given(spec=legal_specs("linear").filter(causal_linear), data=st.data())
def test_chunk_sizes_agree(spec, data):
    op = attngen.load(spec)
    case = data.draw(shapes(op.spec).filter(lambda c: c.shape.q_len > 16), label="case")
    inputs = random_inputs(op.spec, case.shape, seed=data.draw(st.integers(0, 999)),
                           initial_state=case.initial_state)
    base = grads(op, inputs, form="chunked", chunk_size=16)
    for chunk in (32, 64):
        assert_close(grads(op, inputs, form="chunked", chunk_size=chunk), base, f"chunk {chunk} vs 16")


@settings(max_examples=40, **SETTINGS)
@given(spec=legal_specs(), data=st.data())
def test_all_forms_agree(spec, data):
    op = attngen.load(spec)
    case = data.draw(shapes(op.spec), label="case")
    inputs = random_inputs(op.spec, case.shape, seed=data.draw(st.integers(0, 999)),
                           initial_state=case.initial_state)
    choices = list(form_choices(op, chunks=(16, 64)))
    base = grads(op, inputs, form=choices[0][0], chunk_size=choices[0][1])
    for form, chunk in choices[1:]:
        assert_close(grads(op, inputs, form=form, chunk_size=chunk), base, f"{form} chunk={chunk} vs {choices[0]}")
    # The planner's own choice is one of them.
    assert_close(grads(op, inputs), base, "planner's choice")


# --------------------------------------------------------------------------- decay relations

DECAY_SHAPES = [
    Shape(batch=2, q_len=37, heads=2, head_dim=6, value_dim=5),
    Shape(batch=1, q_len=70, heads=3, head_dim=4, value_dim=7),
    Shape(batch=1, q_len=41, heads=2, head_dim=5, value_dim=3, cu_seqlens=(0, 1, 17, 41)),
]
FORMS = [("recurrent", None), ("parallel", None), ("chunked", 16), ("chunked", 64)]


@pytest.mark.parametrize("shape", DECAY_SHAPES, ids=lambda s: f"T{s.q_len}{'_varlen' if s.cu_seqlens else ''}")
@pytest.mark.parametrize("form,chunk", FORMS)
def test_gated_delta_with_zero_gate_equals_deltanet(shape, form, chunk):
    gated, plain = attngen.load("specs/gated_deltanet.yaml"), attngen.load("specs/deltanet.yaml")
    inputs = random_inputs(plain.spec, shape, seed=5)
    g = torch.zeros(shape.batch, shape.q_len, shape.heads, dtype=torch.float64)
    want = grads(plain, inputs, form=form, chunk_size=chunk)
    got = grads(gated, dict(inputs, g=g), form=form, chunk_size=chunk)
    got.pop("dg")
    assert_close(got, want, f"gated_deltanet with g = 0 vs deltanet, {form}")


@pytest.mark.parametrize("update", ["additive", "delta"])
@pytest.mark.parametrize("shape", DECAY_SHAPES, ids=lambda s: f"T{s.q_len}{'_varlen' if s.cu_seqlens else ''}")
@pytest.mark.parametrize("form,chunk", FORMS)
def test_scalar_decay_broadcast_to_vector_equals_vector_decay(update, shape, form, chunk):
    base = {"name": "decay_rel", "attention": "linear", "qk_norm": "l2", "update": update}
    scalar = attngen.load({**base, "decay": "scalar"})
    vector = attngen.load({**base, "decay": "vector"})
    inputs = random_inputs(scalar.spec, shape, seed=7)
    K = shape.head_dim
    want = grads(scalar, inputs, form=form, chunk_size=chunk)
    # dg of the broadcast is the sum over the vector's channels: autograd of expand gives it.
    got = outputs_and_grads(
        lambda g, **a: vector(g=g[..., None].expand(*g.shape, K), **a, form=form, chunk_size=chunk),
        vector.spec, inputs, with_grads=True)
    assert_close(got, want, f"{update}: vector decay of a broadcast scalar vs scalar decay, {form}")


@pytest.mark.parametrize("update", ["additive", "delta"])
@pytest.mark.parametrize("shape", DECAY_SHAPES, ids=lambda s: f"T{s.q_len}{'_varlen' if s.cu_seqlens else ''}")
@pytest.mark.parametrize("form,chunk", FORMS)
def test_constant_decay_equals_scalar_decay_broadcast(update, shape, form, chunk):
    base = {"name": "decay_rel", "attention": "linear", "qk_norm": "l2", "update": update}
    constant = attngen.load({**base, "decay": "constant"})
    scalar = attngen.load({**base, "decay": "scalar"})
    inputs = random_inputs(constant.spec, shape, seed=11)
    B, T = shape.batch, shape.q_len
    want = grads(constant, inputs, form=form, chunk_size=chunk)
    got = outputs_and_grads(
        lambda g, **a: scalar(g=g[None, None, :].expand(B, T, -1), **a, form=form, chunk_size=chunk),
        scalar.spec, inputs, with_grads=True)
    assert_close(got, want, f"{update}: scalar decay of a broadcast constant vs constant decay, {form}")


# --------------------------------------------------------------------------- varlen

@settings(max_examples=40, **SETTINGS)
@given(spec=legal_specs(), data=st.data())
def test_varlen_equals_separate_calls(spec, data):
    op = attngen.load(spec)
    case = data.draw(shapes(op.spec, varlen=True), label="case")
    cu = case.shape.cu_seqlens
    inputs = random_inputs(op.spec, case.shape, seed=data.draw(st.integers(0, 999)),
                           initial_state=case.initial_state)
    for form, chunk in form_choices(op):
        packed = run(op, inputs, form=form, chunk_size=chunk)
        outs, states = [], []
        for n, (start, end) in enumerate(pairwise(cu)):
            one = time_slice(op.spec, inputs, start, end)
            one.pop("cu_seqlens")
            if "initial_state" in one:
                one["initial_state"] = inputs["initial_state"][n: n + 1]
            got = run(op, one, form=form, chunk_size=chunk)
            outs.append(got["o"])
            states.append(got.get("final_state"))
        separate = {"o": torch.cat(outs, 1)}
        if op.spec.is_linear:
            separate["final_state"] = torch.cat(states, 0)
        assert_close(packed, separate, f"{form} chunk={chunk}, cu_seqlens={cu}")


# --------------------------------------------------------------------------- normalizer, softmax

@settings(max_examples=30, **SETTINGS)
@given(spec=legal_specs("linear").filter(lambda s: s["normalize"] == "sum"), data=st.data())
def test_normalize_sum_equals_additive_on_ones_column(spec, data):
    op = attngen.load(spec)
    additive = attngen.load({**spec, "normalize": "none"})
    case = data.draw(shapes(op.spec), label="case")
    inputs = random_inputs(op.spec, case.shape, seed=data.draw(st.integers(0, 999)),
                           initial_state=case.initial_state)
    V = case.shape.value_dim
    aug = dict(inputs, v=torch.cat([inputs["v"], torch.ones_like(inputs["v"][..., :1])], -1))
    for form, chunk in form_choices(op):
        want = run(additive, aug, form=form, chunk_size=chunk)
        want["o"] = want["o"][..., :V] / (want["o"][..., V:] + NORM_EPS)
        assert_close(run(op, inputs, form=form, chunk_size=chunk), want, f"{form} chunk={chunk}")


@settings(max_examples=30, **SETTINGS)
@given(spec=legal_specs("softmax"), data=st.data())
def test_softmax_short_queries_equal_last_rows(spec, data):
    op = attngen.load(spec)
    case = data.draw(shapes(op.spec, varlen=False).filter(lambda c: c.shape.q_len >= 2), label="case")
    Tk = case.shape.q_len
    Tq = data.draw(st.integers(1, Tk - 1), label="Tq")
    note(f"Tq = {Tq}, Tk = {Tk}")
    inputs = random_inputs(op.spec, case.shape, seed=data.draw(st.integers(0, 999)))
    whole = op(**inputs)
    got = op(**dict(inputs, q=inputs["q"][:, Tk - Tq:]))
    assert_close({"o": got}, {"o": whole[:, Tk - Tq:]}, f"Tq = {Tq} of Tk = {Tk}")
