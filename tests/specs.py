"""The specs the tests run, in one registry: the shipped specs, read from specs/, and the variants
the kernel tests run beside them, with the kernel tests (forms) each applies to.

Tests name an entry by its key, which is also its test id. A variant is a spec dict: a shipped
spec made cheaper for Triton's interpreter (16 FAVOR+ features, not 64) or a combination no
shipped spec has, for a branch of the templates. Each distinct spec has one entry and one name:
a session renders its module once, whichever test files run it, and no two specs share a name
(torch.ops.attngen.<name> belongs to the first module of a name).

Tolerances are not per spec: attngen.testing.compare sets each from the error of the same
computation in plain low-precision PyTorch (DESIGN.md §7).
"""
from __future__ import annotations

from pathlib import Path

from attngen import load_spec

ROOT = Path(__file__).resolve().parents[1]

# specs/<name>.yaml by name, sorted
SHIPPED: dict[str, Path] = {p.stem: p for p in sorted((ROOT / "specs").glob("*.yaml"))}


def shipped(attention: str | None = None) -> list[Path]:
    """The shipped spec files, sorted by name; with `attention`, those of that family."""
    return [p for p in SHIPPED.values() if attention is None or load_spec(p).attention == attention]


def stem(path: Path) -> str:
    """A spec file's test id: its name."""
    return path.stem


def _shipped(name: str) -> dict:
    return load_spec(SHIPPED[name]).to_dict()


def _linear(name: str, mask: str = "causal", **fields) -> dict:
    return {"name": name, "attention": "linear", "mask": mask, **fields}


def _softmax(name: str, **fields) -> dict:
    return {"name": name, "attention": "softmax", **fields}


FAVOR_16 = {"features": 16, "orthogonal": True, "seed": 0}

# Causal linear attention: the recurrent and chunked kernels, forward and backward.
CAUSAL_LINEAR: dict[str, dict] = {
    "identity": _linear("identity_additive"),
    "linear_transformer": _shipped("linear_transformer"),
    "performer": _linear("performer_16", feature_map="favor_plus", normalize="sum", favor_plus=FAVOR_16),
    "deltanet": _shipped("deltanet"),
    "gated_deltanet": _shipped("gated_deltanet"),
    "mamba2": _shipped("mamba2"),
    "retnet": _shipped("retnet"),
    "gla": _shipped("gla"),
    "kda": _shipped("kda"),
    # expression maps with the l2 norm, a scalar decay and the sum normalizer
    "expr_map": _linear("expr_map", feature_map={"expr": "log(1+exp(x))"}, qk_norm="l2", decay="scalar",
                        normalize="sum", scale=0.5),
    "expr_l2_sum": _linear("expr_l2_sum", feature_map={"expr": "x*x + 1"}, qk_norm="l2", normalize="sum",
                           decay="scalar"),
    # a vector decay with the normalizer and relu features; the delta rule through FAVOR+
    "gla_sum": _linear("gla_sum", feature_map="relu", decay="vector", normalize="sum"),
    "delta_favor": _linear("delta_favor", feature_map="favor_plus", update="delta", decay="scalar",
                           favor_plus=FAVOR_16),
    # FAVOR+ without the normalizer (step 2 reads its own stored query features back, past a barrier) and
    # with the l2 norm (dq and dk project again: the norm's gradient takes the features before it)
    "favor_plain": _linear("favor_plain", feature_map="favor_plus", favor_plus=FAVOR_16),
    "favor_l2": _linear("favor_l2", feature_map="favor_plus", qk_norm="l2", normalize="sum", favor_plus=FAVOR_16),
    # a constant decay with the delta rule (no chunked backward kernel: the PyTorch form's) and
    # with the normalizer
    "delta_constant": _linear("delta_constant", qk_norm="l2", update="delta", decay="constant"),
    "sum_constant": _linear("sum_constant", feature_map="elu_plus_one", normalize="sum", decay="constant"),
}

# The entries of CAUSAL_LINEAR each kernel test runs through all of its cases.
RUNS: dict[str, tuple[str, ...]] = {
    "recurrent": ("gated_deltanet", "kda", "sum_constant", "performer"),
    "recurrent_bwd": ("linear_transformer", "performer", "deltanet", "gated_deltanet", "mamba2", "retnet", "gla",
                      "kda", "expr_l2_sum"),
    "chunked": ("linear_transformer", "performer", "deltanet", "gated_deltanet", "mamba2", "retnet", "gla", "kda",
                "expr_map", "favor_plain"),
    "chunked_bwd": ("identity", "linear_transformer", "performer", "mamba2", "retnet", "gla", "expr_map", "gla_sum",
                    "deltanet", "gated_deltanet", "kda", "delta_favor", "favor_plain", "favor_l2"),
}


def causal_linear(test: str) -> dict[str, dict]:
    """The entries a kernel test of RUNS runs, by key."""
    return {key: CAUSAL_LINEAR[key] for key in RUNS[test]}


# Bidirectional linear attention: the bidirectional kernel (state, then readout).
BIDIRECTIONAL: dict[str, dict] = {
    "identity": _shipped("linear_bidirectional"),
    "linear_transformer": _linear("bi_linear_transformer", "bidirectional", feature_map="elu_plus_one",
                                  normalize="sum"),
    "relu": _linear("bi_relu", "bidirectional", feature_map="relu"),
    "performer": _linear("bi_performer", "bidirectional", feature_map="favor_plus", normalize="sum",
                         favor_plus=FAVOR_16),
    "l2": _linear("bi_l2", "bidirectional", qk_norm="l2"),
    "expr_map": _linear("bi_expr_map", "bidirectional", feature_map={"expr": "log(1+exp(x))"}, qk_norm="l2",
                        normalize="sum", scale=0.5),
}

# Softmax attention: the softmax kernels, forward and backward. Windows of 1 (each query sees one
# key: some gradients are zero by structure), 3 and 16 (edges inside a tile); the decay bias
# under the causal mask and under a window.
SOFTMAX: dict[str, dict] = {
    "causal": _shipped("softmax_causal"),
    "bidirectional": _shipped("softmax_bidirectional"),
    "window1": _softmax("sm_window1", mask="sliding_window", window=1),
    "window3": _softmax("sm_window3", mask="sliding_window", window=3),
    "window16": _softmax("sm_window16", mask="sliding_window", window=16),
    "forgetting": _shipped("forgetting_attention"),
    "window_decay": _softmax("sm_window_decay", mask="sliding_window", window=16, decay="scalar"),
}
