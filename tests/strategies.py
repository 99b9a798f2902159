"""Hypothesis strategies over the legal spec space and small call shapes (DESIGN.md §7).

`legal_specs()` draws spec dicts that attngen.load accepts; `shapes(spec)` draws a small
call shape for a loaded Spec (odd T, K != V, varlen, Tq < Tk for softmax) and whether to
pass an initial state. Inputs themselves come from attngen.testing.random_inputs.
"""
from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from attngen.spec import Spec
from attngen.testing import Shape

# Elementwise feature maps written as expressions. All of these are positive everywhere, so
# they may also feed a sum normalizer.
POSITIVE_EXPRS = (
    "exp(x)",
    "x*x+1",
    "Piecewise((x+1, x>0), (exp(x), True))",
    "log(1+exp(x))",
)
# Feature maps with positive (or non-negative) values: the only ones drawn with normalize: sum,
# where a sign-changing map makes z.q cross zero and the normalised output ill conditioned.
POSITIVE_MAPS = ("elu_plus_one", "relu", "favor_plus")
ALL_NAMED_MAPS = ("identity",) + POSITIVE_MAPS
# relu is only non-negative: a token whose q has one active channel gets an output that
# depends on q only through the normaliser's eps, so dq is a cancellation of relative size
# eps / (z.q). float64 still matches to 1e-9; float32 rounding of it is luck, 4x of the
# interpreter's own error is not a bound (tests/test_forms.py draws these only in float64).
STRICTLY_POSITIVE_MAPS = ("elu_plus_one", "favor_plus")

SEQ_LENS = (1, 2, 7, 16, 33, 63, 100)
SCALES = ("auto", 0.25, 0.5, 1.0, 1.7)


@st.composite
def _feature_map(draw, positive: tuple[str, ...] | None):
    named = positive if positive is not None else ALL_NAMED_MAPS
    fm = draw(st.sampled_from(named + tuple({"expr": e} for e in POSITIVE_EXPRS)))
    return dict(fm) if isinstance(fm, dict) else fm


@st.composite
def linear_specs(draw, sum_maps: tuple[str, ...] = POSITIVE_MAPS, contractive_delta: bool = False) -> dict:
    mask = draw(st.sampled_from(("causal", "causal", "causal", "bidirectional")))
    bidirectional = mask == "bidirectional"
    # Bidirectional linear attention: additive, no decay (spec.py's combination rules).
    update = "additive" if bidirectional else draw(st.sampled_from(("additive", "delta")))
    normalize = "none" if update == "delta" else draw(st.sampled_from(("none", "sum")))
    fm = draw(_feature_map(positive=sum_maps if normalize == "sum" else None))
    decays = ("none",) if bidirectional else ("none", "constant", "scalar", "vector")
    if fm == "favor_plus":
        decays = tuple(d for d in decays if d != "vector")
    spec = {
        "name": "hyp_linear",
        "attention": "linear",
        "feature_map": fm,
        # contractive_delta: the delta rule only on unit keys, where I - beta k k^T is a
        # contraction; without the l2 norm it amplifies by |1 - beta |k|^2| per token.
        "qk_norm": "l2" if contractive_delta and update == "delta" else draw(st.sampled_from(("none", "l2"))),
        "update": update,
        "decay": draw(st.sampled_from(decays)),
        "normalize": normalize,
        "mask": mask,
        "scale": draw(st.sampled_from(SCALES)),
    }
    if fm == "favor_plus":
        spec["favor_plus"] = {
            "features": draw(st.integers(4, 12)),
            "orthogonal": draw(st.booleans()),
            "seed": draw(st.integers(0, 2**32)),
        }
    return spec


@st.composite
def softmax_specs(draw) -> dict:
    mask = draw(st.sampled_from(("causal", "bidirectional", "sliding_window")))
    decay = "none" if mask == "bidirectional" else draw(st.sampled_from(("none", "scalar")))
    spec = {"name": "hyp_softmax", "attention": "softmax", "decay": decay, "mask": mask,
            "scale": draw(st.sampled_from(SCALES))}
    if mask == "sliding_window":
        spec["window"] = draw(st.integers(1, 8))
    return spec


def causal_linear(spec_dict: dict) -> bool:
    """A filter for legal_specs(): the causal linear specs (the recurrent and chunked kernels')."""
    return spec_dict["attention"] == "linear" and spec_dict.get("mask", "causal") == "causal"


def legal_specs(attention: str | None = None, sum_maps: tuple[str, ...] = POSITIVE_MAPS,
                contractive_delta: bool = False) -> st.SearchStrategy[dict]:
    """Spec dicts from the whole legal spec space (or one attention family). sum_maps: the
    named feature maps drawn with normalize: sum (the expressions are always drawn too);
    contractive_delta: draw the delta rule only with qk_norm: l2."""
    if attention == "linear":
        return linear_specs(sum_maps, contractive_delta)
    if attention == "softmax":
        return softmax_specs()
    # The linear family has most of the spec space; weight it 3:1.
    return st.sampled_from(("linear", "linear", "linear", "softmax")).flatmap(
        lambda a: linear_specs(sum_maps, contractive_delta) if a == "linear" else softmax_specs())


@dataclasses.dataclass(frozen=True)
class Case:
    """A drawn call shape and whether the call passes an initial state (linear only)."""

    shape: Shape
    initial_state: bool


@st.composite
def _cu_seqlens(draw, max_total: int | None, one_token_ok: bool) -> tuple[int, ...]:
    """2-4 packed sequences with random lengths, length-1 sequences included."""
    n = draw(st.integers(2, 4))
    pool = [t for t in (1, 1, 2, 3, 5, 7, 9, 16, 17, 33, 40) if max_total is None or t <= max_total // 4]
    lens = draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n))
    if not one_token_ok and max(lens) == 1:
        lens[draw(st.integers(0, n - 1))] = 2
    cu = [0]
    for length in lens:
        cu.append(cu[-1] + length)
    return tuple(cu)


@st.composite
def shapes(draw, spec: Spec, varlen: bool | None = None, max_len: int | None = None, min_head_dim: int = 2) -> Case:
    """A small call shape for `spec`. varlen: force (True) or forbid (False) cu_seqlens;
    max_len: bound T (the packed total with cu_seqlens; keep it >= 8 then)."""
    initial_state = spec.is_linear and draw(st.booleans())
    # Without an initial state, a call whose every sequence is one token long leaves some
    # gradient exactly zero (or of size eps) by structure: the decay acts on a zero state,
    # so dg == 0; a sum-normalised o = v (k.q) / (k.q + eps) depends on q only through eps.
    # A form's rounding noise on an exact zero is an infinite relative error, so some
    # sequence must then be at least two tokens long.
    one_token_ok = initial_state or (spec.normalize == "none" and (spec.decay == "none" or not spec.is_linear))
    heads = draw(st.integers(1, 3))
    head_dim = draw(st.integers(min_head_dim, 12))
    value_dim = draw(st.integers(2, 12))
    use_varlen = draw(st.booleans()) if varlen is None else varlen
    k_len = None
    if use_varlen:
        cu = draw(_cu_seqlens(max_len, one_token_ok))
        batch, q_len = 1, cu[-1]
    else:
        cu = None
        batch = draw(st.integers(1, 2))
        lens = [t for t in SEQ_LENS if (max_len is None or t <= max_len) and (one_token_ok or t > 1)]
        q_len = draw(st.sampled_from(lens))
        longer = [t for t in lens if t > q_len]
        if not spec.is_linear and longer and draw(st.booleans()):
            k_len = draw(st.sampled_from(longer))       # Tq < Tk: queries align to the end
    shape = Shape(batch=batch, q_len=q_len, heads=heads, head_dim=head_dim, value_dim=value_dim,
                  k_len=k_len, cu_seqlens=cu)
    return Case(shape, initial_state)
