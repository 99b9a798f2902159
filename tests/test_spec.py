"""attngen.spec: shipped specs, bad specs (one error each, naming file, line, field, value),
fuzzing (nothing but SpecError escapes), and the legal spec space (DESIGN.md §1)."""
from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attngen.spec import SCALE_MAX, Spec, SpecError, load_spec, parse_spec, schema

SPECS_DIR = Path(__file__).resolve().parents[1] / "specs"
SHIPPED = sorted(SPECS_DIR.glob("*.yaml"))

EXPECTED_SHIPPED = {
    "linear_transformer", "performer", "performer_bidirectional", "deltanet", "gated_deltanet",
    "mamba2", "retnet", "gla", "kda", "linear_bidirectional", "softmax_causal",
    "softmax_bidirectional", "sliding_window", "forgetting_attention",
}


# --------------------------------------------------------------------------- shipped specs

def test_every_seed_system_is_shipped():
    assert EXPECTED_SHIPPED <= {p.stem for p in SHIPPED}


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_spec_loads_and_round_trips(path):
    spec = load_spec(path)
    assert isinstance(spec, Spec)
    assert spec.name == path.stem
    assert spec.source == str(path)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and len(first) > 4, "a one-line comment naming the system comes first"

    again = load_spec(spec.to_dict())
    assert again == spec
    assert again.hash == spec.hash
    assert again.to_dict() == spec.to_dict()
    assert load_spec(spec) is spec
    # Through YAML text too, and the hash does not depend on how the file was written.
    assert parse_spec(yaml.safe_dump(spec.to_dict()), "dumped.yaml") == spec
    assert load_spec(path).hash == spec.hash
    assert len(spec.hash) == 16 and int(spec.hash, 16) >= 0


def test_shipped_spec_contents():
    s = {p.stem: load_spec(p) for p in SHIPPED}
    lt = s["linear_transformer"]
    assert (lt.feature_map, lt.update, lt.normalize, lt.mask) == ("elu_plus_one", "additive", "sum", "causal")
    for name, mask in (("performer", "causal"), ("performer_bidirectional", "bidirectional")):
        p = s[name]
        assert p.feature_map == "favor_plus" and p.normalize == "sum" and p.mask == mask
        assert (p.favor_plus.features, p.favor_plus.orthogonal, p.favor_plus.seed) == (64, True, 0)
    expect = {  # name: (attention, update, decay, qk_norm)
        "deltanet": ("linear", "delta", "none", "l2"),
        "gated_deltanet": ("linear", "delta", "scalar", "l2"),
        "mamba2": ("linear", "additive", "scalar", "none"),
        "retnet": ("linear", "additive", "constant", "none"),
        "gla": ("linear", "additive", "vector", "none"),
        "kda": ("linear", "delta", "vector", "l2"),
        "linear_bidirectional": ("linear", "additive", "none", "none"),
        "softmax_causal": ("softmax", "additive", "none", "none"),
        "softmax_bidirectional": ("softmax", "additive", "none", "none"),
        "sliding_window": ("softmax", "additive", "none", "none"),
        "forgetting_attention": ("softmax", "additive", "scalar", "none"),
    }
    for name, (attention, update, decay, qk_norm) in expect.items():
        assert (s[name].attention, s[name].update, s[name].decay, s[name].qk_norm) == \
            (attention, update, decay, qk_norm), name
    assert s["linear_bidirectional"].mask == "bidirectional"
    assert s["softmax_bidirectional"].mask == "bidirectional"
    assert (s["sliding_window"].mask, s["sliding_window"].window) == ("sliding_window", 1024)
    assert all(spec.scale is None for spec in s.values())


# --------------------------------------------------------------------------- bad specs

def y(*lines: str) -> str:
    return "\n".join(lines) + "\n"


LIN = ("name: a", "attention: linear")        # lines 1-2
SOFT = ("name: a", "attention: softmax")      # lines 1-2
FAVOR = (*LIN, "feature_map: favor_plus", "favor_plus:")   # subfields start on line 5
EXPR = (*LIN, "feature_map:")                 # expr on line 4

# (id, text, field named in the message, offending value as it appears, line of the field)
BAD = [
    ("unknown_field", y(*LIN, "colour: red"), "colour", "'colour'", 3),
    ("unknown_field_first", y("heads: 4", *LIN), "heads", "'heads'", 1),
    ("missing_name", y("attention: linear"), "name", None, None),
    ("missing_attention", y("name: a"), "attention", None, None),
    ("name_pattern_dash", y("name: Bad-Name", "attention: linear"), "name", "'Bad-Name'", 1),
    ("name_pattern_digit", y("attention: linear", "name: 9lives"), "name", "'9lives'", 2),
    ("name_pattern_space", y("name: 'a b'", "attention: linear"), "name", "'a b'", 1),
    ("name_empty", y("name: ''", "attention: linear"), "name", "''", 1),
    ("name_list", y("name: [a, b]", "attention: linear"), "name", "['a', 'b']", 1),
    ("name_int", y("name: 5", "attention: linear"), "name", "5", 1),
    ("name_bool", y("name: true", "attention: linear"), "name", "True", 1),
    ("name_null", y("name:", "attention: linear"), "name", "None", 1),
    ("attention_enum", y("name: a", "attention: rnn"), "attention", "'rnn'", 2),
    ("attention_list", y("name: a", "attention: [linear]"), "attention", "['linear']", 2),
    ("attention_int", y("name: a", "attention: 1"), "attention", "1", 2),
    ("feature_map_enum", y(*LIN, "feature_map: gelu"), "feature_map", "'gelu'", 3),
    ("feature_map_int", y(*LIN, "feature_map: 3"), "feature_map", "3", 3),
    ("feature_map_list", y(*LIN, "feature_map: [relu]"), "feature_map", "['relu']", 3),
    ("qk_norm_enum", y(*LIN, "qk_norm: l1"), "qk_norm", "'l1'", 3),
    ("qk_norm_bool", y(*LIN, "qk_norm: true"), "qk_norm", "True", 3),
    ("update_enum", y(*LIN, "update: gated"), "update", "'gated'", 3),
    ("decay_enum", y(*LIN, "decay: exponential"), "decay", "'exponential'", 3),
    ("decay_null", y(*LIN, "decay: null"), "decay", "None", 3),
    ("normalize_enum", y(*LIN, "normalize: max"), "normalize", "'max'", 3),
    ("normalize_bool", y(*LIN, "normalize: no"), "normalize", "False", 3),
    ("mask_enum", y(*LIN, "mask: local"), "mask", "'local'", 3),
    ("mask_list", y(*SOFT, "mask: [causal]"), "mask", "['causal']", 3),
    ("softmax_mask_enum", y(*SOFT, "mask: diagonal"), "mask", "'diagonal'", 3),
    # softmax with the linear-only fields
    ("softmax_feature_map", y(*SOFT, "feature_map: elu_plus_one"), "feature_map", "'elu_plus_one'", 3),
    ("softmax_feature_expr", y(*SOFT, "feature_map: {expr: exp(x)}"), "feature_map", "'exp(x)'", 3),
    ("softmax_qk_norm", y(*SOFT, "qk_norm: l2"), "qk_norm", "'l2'", 3),
    ("softmax_update", y(*SOFT, "update: delta"), "update", "'delta'", 3),
    ("softmax_normalize", y(*SOFT, "normalize: sum"), "normalize", "'sum'", 3),
    ("softmax_favor_block", y(*SOFT, "favor_plus: {features: 8}"), "favor_plus", "'features': 8", 3),
    ("softmax_decay_vector", y(*SOFT, "decay: vector"), "decay", "'vector'", 3),
    ("softmax_decay_constant", y(*SOFT, "decay: constant"), "decay", "'constant'", 3),
    # favor_plus
    ("favor_block_without_map", y(*LIN, "favor_plus: {features: 8}"), "favor_plus", "'features': 8", 3),
    ("favor_block_with_relu", y(*LIN, "feature_map: relu", "favor_plus:", "  seed: 1"),
     "favor_plus", "'seed': 1", 4),
    ("favor_features_0", y(*FAVOR, "  features: 0"), "favor_plus.features", "0", 5),
    ("favor_features_10000", y(*FAVOR, "  features: 10000"), "favor_plus.features", "10000", 5),
    ("favor_features_str", y(*FAVOR, "  features: a"), "favor_plus.features", "'a'", 5),
    ("favor_features_bool", y(*FAVOR, "  features: true"), "favor_plus.features", "True", 5),
    ("favor_features_float", y(*FAVOR, "  features: 64.0"), "favor_plus.features", "64.0", 5),
    ("favor_seed_negative", y(*FAVOR, "  features: 8", "  seed: -1"), "favor_plus.seed", "-1", 6),
    ("favor_seed_str", y(*FAVOR, "  seed: abc"), "favor_plus.seed", "'abc'", 5),
    ("favor_seed_float", y(*FAVOR, "  seed: 1.5"), "favor_plus.seed", "1.5", 5),
    ("favor_seed_bool", y(*FAVOR, "  seed: false"), "favor_plus.seed", "False", 5),
    ("favor_seed_huge", y(*FAVOR, "  seed: 100000000000000000000000"), "favor_plus.seed",
     "100000000000000000000000", 5),
    ("favor_orthogonal_str", y(*FAVOR, "  orthogonal: 'yes'"), "favor_plus.orthogonal", "'yes'", 5),
    ("favor_orthogonal_int", y(*FAVOR, "  orthogonal: 1"), "favor_plus.orthogonal", "1", 5),
    ("favor_unknown_subfield", y(*FAVOR, "  features: 8", "  dim: 3"), "favor_plus.dim", "'dim'", 6),
    ("favor_block_list", y(*LIN, "feature_map: favor_plus", "favor_plus: [1, 2]"), "favor_plus", "[1, 2]", 4),
    ("favor_block_int", y(*LIN, "feature_map: favor_plus", "favor_plus: 0"), "favor_plus", "0", 4),
    # window
    ("window_missing", y(*SOFT, "mask: sliding_window"), "window", None, 3),
    ("window_without_sliding", y(*SOFT, "window: 64"), "window", "64", 3),
    ("window_with_causal", y(*SOFT, "mask: causal", "window: 64"), "window", "64", 4),
    ("window_zero", y(*SOFT, "mask: sliding_window", "window: 0"), "window", "0", 4),
    ("window_negative", y(*SOFT, "mask: sliding_window", "window: -1"), "window", "-1", 4),
    ("window_float", y(*SOFT, "mask: sliding_window", "window: 1.5"), "window", "1.5", 4),
    ("window_str", y(*SOFT, "mask: sliding_window", "window: big"), "window", "'big'", 4),
    ("window_bool", y(*SOFT, "mask: sliding_window", "window: true"), "window", "True", 4),
    # combination rules
    ("linear_sliding_window", y(*LIN, "mask: sliding_window", "window: 16"), "mask", "'sliding_window'", 3),
    ("decay_bidirectional_linear", y(*LIN, "mask: bidirectional", "decay: scalar"), "decay", "'scalar'", 4),
    ("vector_decay_bidirectional_linear", y(*LIN, "decay: vector", "mask: bidirectional"), "decay", "'vector'", 3),
    ("delta_bidirectional", y(*LIN, "update: delta", "mask: bidirectional"), "update", "'delta'", 3),
    ("normalize_sum_delta", y(*LIN, "update: delta", "normalize: sum"), "normalize", "'sum'", 4),
    ("vector_decay_favor", y(*LIN, "feature_map: favor_plus", "decay: vector"), "decay", "'vector'", 4),
    ("softmax_bidirectional_scalar", y(*SOFT, "decay: scalar", "mask: bidirectional"), "decay", "'scalar'", 3),
    # scale
    ("scale_zero", y(*LIN, "scale: 0"), "scale", "0", 3),
    ("scale_negative", y(*LIN, "scale: -1"), "scale", "-1", 3),
    ("scale_str", y(*LIN, "scale: big"), "scale", "'big'", 3),
    ("scale_bool", y(*LIN, "scale: true"), "scale", "True", 3),
    ("scale_inf", y(*LIN, "scale: .inf"), "scale", "inf", 3),
    ("scale_nan", y(*SOFT, "scale: .nan"), "scale", "nan", 3),
    ("scale_huge_int", y(*LIN, "scale: 1" + "0" * 400), "scale", "1" + "0" * 400, 3),
    ("scale_past_float32", y(*SOFT, "scale: 1.0e+39"), "scale", "1e+39", 3),
    ("scale_list", y(*SOFT, "scale: [1]"), "scale", "[1]", 3),
    # feature_map expressions
    ("expr_other_symbol", y(*EXPR, "  expr: y"), "feature_map.expr", "'y'", 4),
    ("expr_two_symbols", y(*EXPR, "  expr: x*y"), "feature_map.expr", "'x*y'", 4),
    ("expr_unknown_function", y(*EXPR, "  expr: foo(x)"), "feature_map.expr", "'foo(x)'", 4),
    ("expr_sum", y(*EXPR, "  expr: sum(x)"), "feature_map.expr", "'sum(x)'", 4),
    ("expr_empty", y(*EXPR, "  expr: ''"), "feature_map.expr", "''", 4),
    ("expr_blank", y(*EXPR, "  expr: '   '"), "feature_map.expr", "'   '", 4),
    ("expr_constant", y(*EXPR, "  expr: '1'"), "feature_map.expr", "'1'", 4),
    ("expr_int", y(*EXPR, "  expr: 1"), "feature_map.expr", "1", 4),
    ("expr_list", y(*EXPR, "  expr: [x]"), "feature_map.expr", "['x']", 4),
    ("expr_import", y(*EXPR, "  expr: \"__import__('os')\""), "feature_map.expr", "__import__('os')", 4),
    ("expr_dunder", y(*EXPR, "  expr: x.__class__"), "feature_map.expr", "x.__class__", 4),
    ("expr_attribute", y(*EXPR, "  expr: x.real"), "feature_map.expr", "'x.real'", 4),
    ("expr_relation", y(*EXPR, "  expr: x > 0"), "feature_map.expr", "'x > 0'", 4),
    ("expr_bare_function", y(*EXPR, "  expr: exp"), "feature_map.expr", "'exp'", 4),
    ("expr_syntax", y(*EXPR, "  expr: x +* 2"), "feature_map.expr", "'x +* 2'", 4),
    ("expr_unbalanced", y(*EXPR, "  expr: exp(x"), "feature_map.expr", "'exp(x'", 4),
    ("expr_infinite", y(*EXPR, "  expr: x/0"), "feature_map.expr", "'x/0'", 4),
    ("expr_complex", y(*EXPR, "  expr: x*sqrt(-2)"), "feature_map.expr", "'x*sqrt(-2)'", 4),
    ("expr_lambda", y(*EXPR, "  expr: lambda"), "feature_map.expr", "'lambda'", 4),
    ("expr_piecewise_no_default", y(*EXPR, "  expr: 'Piecewise((x, x > 0))'"), "feature_map.expr",
     "'Piecewise((x, x > 0))'", 4),
    ("expr_power_tower", y(*EXPR, "  expr: x**9**9**9"), "feature_map.expr", "'x**9**9**9'", 4),
    ("expr_unicode", y(*EXPR, "  expr: xÿ"), "feature_map.expr", "'xÿ'", 4),
    ("expr_mapping_extra_key", y(*EXPR, "  expr: x", "  scale: 2"), "feature_map", "'scale': 2", 3),
    ("expr_mapping_wrong_key", y(*EXPR, "  formula: x"), "feature_map", "'formula'", 3),
    ("expr_mapping_empty", y(*LIN, "feature_map: {}"), "feature_map", "{}", 3),
    # YAML itself
    ("duplicate_key", y(*LIN, "name: b"), "name", None, 3),
    ("duplicate_subkey", y(*FAVOR, "  seed: 1", "  seed: 2"), "favor_plus.seed", None, 6),
    ("non_scalar_key", y("? [a, b]", ": 1", *LIN), None, None, 1),
    ("malformed_indent", y(*LIN, "  decay: scalar"), None, None, 3),
    ("malformed_flow", y(*LIN, "mask: [causal", "decay: none"), None, None, 4),
    ("malformed_tab", y(*LIN, "\tdecay: scalar"), None, None, 3),
    ("malformed_unknown_tag", y(*LIN, "decay: !thing scalar"), None, None, 3),
    ("malformed_python_tag", y(*LIN, "decay: !!python/object:os.system ls"), None, None, 3),
    ("malformed_two_documents", y(*LIN, "---", *LIN), None, None, 3),
    ("malformed_bad_date", y("name: 2001-13-45", "attention: linear"), None, "'2001-13-45'", 1),
    ("malformed_bad_bool", y(*LIN, "mask: !!bool maybe"), None, "'maybe'", 3),
    ("malformed_bad_timestamp", y(*LIN, "favor_plus:", "  seed: !!timestamp soon"), None, "'soon'", 4),
    ("malformed_bad_int", y(*LIN, "window: !!int 0x"), None, "'0x'", 3),
    ("malformed_empty_int", y(*LIN, "window: !!int "), None, "''", 3),
    ("empty_file", "", None, None, None),
    ("comment_only_file", y("# nothing here"), None, None, None),
    ("top_level_list", y("- name: a", "- attention: linear"), None, None, 1),
    ("top_level_scalar", y("linear attention please"), None, None, 1),
    ("deep_nesting", "name: " + "[" * 3000 + "]" * 3000 + "\nattention: linear\n", None, None, None),
    # bounds on sizes and integers (the limits are in the messages)
    ("name_too_long", y("name: " + "a" * 300, "attention: linear"), "name", "(300 characters)", 1),
    ("window_int32", y(*SOFT, "mask: sliding_window", "window: 2147483648"), "window", "2147483648", 4),
    ("window_over_max", y(*SOFT, "mask: sliding_window", "window: 1073741825"), "window", "1073741825", 4),
    ("expr_nested_exp", y(*EXPR, "  expr: " + "exp(" * 150 + "x" + ")" * 150), "feature_map.expr",
     "(751 characters)", 4),
    ("expr_deep_tree", y(*EXPR, "  expr: x" + "**x" * 40), "feature_map.expr", "(121 characters)", 4),
    # feature maps outside their domain for part of the reals (NaN, Inf, or an infinite derivative)
    ("expr_log", y(*EXPR, "  expr: log(x)"), "feature_map.expr", "'log(x)' is not a feature map on all real x", 4),
    ("expr_half_power", y(*EXPR, "  expr: x**0.5"), "feature_map.expr", "'x**0.5' is not a feature map", 4),
    ("expr_sqrt", y(*EXPR, "  expr: sqrt(x)"), "feature_map.expr", "gives nan at x = -5e-324", 4),
    ("expr_pole", y(*EXPR, "  expr: 1/x"), "feature_map.expr", "'1/x' is not a feature map", 4),
    ("expr_pole_off_grid", y(*EXPR, "  expr: 1/(x - 0.3)"), "feature_map.expr", "gives inf at x = 0.3", 4),
    ("expr_log_shifted", y(*EXPR, "  expr: log(x - 1)"), "feature_map.expr", "'log(x - 1)' is not a", 4),
    ("expr_cube_root", y(*EXPR, "  expr: x**(1/3)"), "feature_map.expr", "'x**(1/3)' is not a", 4),
    ("expr_infinite_derivative", y(*EXPR, "  expr: Abs(x)**0.5"), "feature_map.expr", "its derivative", 4),
    ("expr_too_long", y(*EXPR, "  expr: " + "x+" * 600 + "x"), "feature_map.expr", "(1201 characters)", 4),
    ("expr_too_many_terms", y(*EXPR, "  expr: " + "+".join(["x*x"] * 200)), "feature_map.expr",
     "(799 characters)", 4),
    ("expr_wide_max", y(*EXPR, "  expr: Max(" + ",".join(f"x*{i}" for i in range(20)) + ")"),
     "feature_map.expr", "Max(x*0,x*1", 4),
    ("spec_too_large", y(*LIN, "# " + "padding " * 9000), None, "65536 bytes", None),
    ("recursive_alias", y("name: &a [*a]", "attention: linear"), None, None, None),
    ("alias_bomb", y(*LIN, "colour:", *(f"  a{i}: &a{i} [*a{i - 1}, *a{i - 1}]" if i else "  a0: &a0 [1, 1]"
                                        for i in range(40))), None, "10000", None),
]


@pytest.mark.parametrize("text, field, value, line", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_spec(text, field, value, line):
    with pytest.raises(SpecError) as info:
        parse_spec(text, "bad.yaml")
    err = info.value
    msg = str(err)
    assert isinstance(err, ValueError)
    assert "Traceback" not in msg
    assert msg.startswith("bad.yaml")
    assert err.source == "bad.yaml"
    if field is not None:
        assert f"'{field}'" in msg, msg
        assert err.field == field
    if value is not None:
        assert value in msg, msg
    if line is not None:
        assert f"bad.yaml:{line}:" in msg, msg
        assert err.line == line
    if field is not None and value is not None:
        assert "allowed" in msg, msg   # says what is allowed


def test_bad_table_is_large():
    assert len(BAD) >= 30
    assert len({c[0] for c in BAD}) == len(BAD)


def test_error_names_the_file_path(tmp_path):
    path = tmp_path / "oops.yaml"
    path.write_text(y(*LIN, "decay: sometimes"))
    with pytest.raises(SpecError, match=r"oops\.yaml:3: field 'decay': value 'sometimes'"):
        load_spec(path)
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "missing.yaml")
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path)
    with pytest.raises(SpecError, match="cannot read"):
        load_spec("bad\0path.yaml")
    (tmp_path / "latin1.yaml").write_bytes(b"name: caf\xe9\n")
    with pytest.raises(SpecError, match="UTF-8"):
        load_spec(tmp_path / "latin1.yaml")
    with pytest.raises(SpecError, match="expected a path"):
        load_spec(42)


def test_dict_errors_name_field_and_value():
    with pytest.raises(SpecError, match=r"field 'decay': value 'scalar' is not allowed"):
        load_spec({"name": "a", "attention": "softmax", "mask": "bidirectional", "decay": "scalar"})
    with pytest.raises(SpecError, match=r"unknown field 7"):
        load_spec({"name": "a", "attention": "linear", 7: 1})


def test_spec_defaults_and_scale():
    s = parse_spec(y(*LIN), "ok.yaml")
    assert (s.feature_map, s.qk_norm, s.update, s.decay, s.normalize, s.mask, s.window, s.scale) == \
        ("identity", "none", "additive", "none", "none", "causal", None, None)
    assert s.default_scale(16) == 0.25
    assert parse_spec(y(*LIN, "scale: 2"), "ok.yaml").scale == 2.0
    f = parse_spec(y(*LIN, "feature_map: favor_plus"), "ok.yaml")
    assert f.favor_plus.features == 64 and f.default_scale(16) == 1.0 and f.feature_dim(16) == 64
    # favor_plus: with an empty value takes the defaults.
    assert parse_spec(y(*LIN, "feature_map: favor_plus", "favor_plus:"), "ok.yaml") == f
    # Softmax may spell out the linear-only fields at their defaults.
    assert parse_spec(y(*SOFT, "qk_norm: none", "update: additive", "normalize: none"), "ok.yaml") == \
        parse_spec(y(*SOFT), "ok.yaml")


# --------------------------------------------------------------------------- fuzzing

FIELDS = list(schema()["fields"])
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["linear", "softmax", "identity", "favor_plus", "sum", "delta", "vector", "scalar",
                     "causal", "bidirectional", "sliding_window", "auto", "l2", "none", "x", "exp(x)"]),
)
nested = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8) | st.sampled_from(FIELDS),
                                                                      children, max_size=4),
    max_leaves=12,
)
EXPR_TOKENS = ["x", "exp", "log", "sqrt", "tanh", "Abs", "Max", "Min", "Piecewise", "True", "pi", "E",
               "(", ")", ",", "+", "-", "*", "/", "**", "<", ">", "1", "2", "0.5", "y", ".", "_"]
exprs = st.lists(st.sampled_from(EXPR_TOKENS), max_size=8).map("".join)


def _assert_only_spec_errors(fn, *args):
    try:
        fn(*args)
    except SpecError as e:
        assert "Traceback" not in str(e)


@FUZZ
@given(st.text(max_size=200))
def test_fuzz_text(text):
    _assert_only_spec_errors(parse_spec, text, "fuzz.yaml")


YAMLISH = st.lists(st.sampled_from(
    ["name", "attention", "feature_map", "favor_plus", "window", "scale", ":", ": ", "\n", "  ", "- ",
     "[", "]", "{", "}", ",", "'", '"', "#", "&a ", "*a", "!!str ", "!!int ", "? ", "linear", "softmax",
     "expr", "x", "1", "-1", ".inf", "null", "true", "2001-13-45", "0x1F", "1:30", "~", "|", ">"]),
    max_size=30).map("".join)


@FUZZ
@given(YAMLISH)
def test_fuzz_yamlish_tokens(text):
    _assert_only_spec_errors(parse_spec, text, "fuzz.yaml")


@FUZZ
@given(nested)
def test_fuzz_nested_structures(obj):
    _assert_only_spec_errors(parse_spec, yaml.safe_dump(obj), "fuzz.yaml")
    if not isinstance(obj, (str, bytes)):  # a str would be read as a path
        _assert_only_spec_errors(load_spec, obj)


field_values = {
    "name": st.one_of(st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True), scalars),
    "attention": st.one_of(st.sampled_from(["linear", "softmax"]), scalars),
    "feature_map": st.one_of(st.sampled_from(["identity", "elu_plus_one", "relu", "favor_plus"]),
                             st.fixed_dictionaries({"expr": exprs}), st.fixed_dictionaries({"expr": scalars}),
                             nested),
    "favor_plus": st.one_of(st.fixed_dictionaries({}, optional={"features": st.integers(-5, 600) | scalars,
                                                                 "orthogonal": st.booleans() | scalars,
                                                                 "seed": st.integers(-5, 2**70) | scalars}),
                            nested),
}


@st.composite
def mixed_dicts(draw):
    d = {}
    for key in draw(st.lists(st.sampled_from(FIELDS) | st.text(max_size=6), max_size=9, unique=True)):
        d[key] = draw(field_values.get(key, scalars) if draw(st.booleans()) else nested)
    return d


@FUZZ
@given(mixed_dicts())
def test_fuzz_mixed_dicts(d):
    _assert_only_spec_errors(load_spec, d)
    _assert_only_spec_errors(parse_spec, yaml.safe_dump(d), "fuzz.yaml")


# --------------------------------------------------------------------------- the legal space

LEGAL_EXPRS = ["exp(x)", "x*x + 1", "Piecewise((x + 1, x > 0), (exp(x), True))", "log(1 + exp(x))",
               "Max(x, 0)", "min(x, 1) + 2", "tanh(x) + sin(x)*cos(x)", "sqrt(x**2 + 1)", "Abs(x)**1.5",
               "x**7 - 2/3*x", "sinh(x) + cosh(x)", "E**x * pi", "2.5e-3*x"]


@st.composite
def legal_spec_dicts(draw):
    """Every legal combination of DESIGN.md §1, defaults sometimes omitted."""
    d = {"name": draw(st.from_regex(r"[a-z][a-z0-9_]{0,15}", fullmatch=True)),
         "attention": draw(st.sampled_from(["linear", "softmax"]))}

    def put(key, value, default):
        if value != default or draw(st.booleans()):
            d[key] = value

    if d["attention"] == "linear":
        mask = draw(st.sampled_from(["causal", "bidirectional"]))
        fm = draw(st.sampled_from(["identity", "elu_plus_one", "relu", "favor_plus", "expr"]))
        update = "additive" if mask == "bidirectional" else draw(st.sampled_from(["additive", "delta"]))
        decays = ["none"] if mask == "bidirectional" else ["none", "constant", "scalar", "vector"]
        if fm == "favor_plus":
            decays = [x for x in decays if x != "vector"]
        put("feature_map", {"expr": draw(st.sampled_from(LEGAL_EXPRS))} if fm == "expr" else fm, "identity")
        if fm == "favor_plus" and draw(st.booleans()):
            d["favor_plus"] = draw(st.fixed_dictionaries({}, optional={
                "features": st.integers(1, 512), "orthogonal": st.booleans(), "seed": st.integers(0, 2**64 - 1)}))
        put("qk_norm", draw(st.sampled_from(["none", "l2"])), "none")
        put("update", update, "additive")
        put("decay", draw(st.sampled_from(decays)), "none")
        put("normalize", "none" if update == "delta" else draw(st.sampled_from(["none", "sum"])), "none")
        put("mask", mask, "causal")
    else:
        mask = draw(st.sampled_from(["causal", "bidirectional", "sliding_window"]))
        put("decay", "none" if mask == "bidirectional" else draw(st.sampled_from(["none", "scalar"])), "none")
        put("mask", mask, "causal")
        if mask == "sliding_window":
            d["window"] = draw(st.integers(1, schema()["fields"]["window"]["max"]))
        for key, default in (("qk_norm", "none"), ("update", "additive"), ("normalize", "none"),
                             ("feature_map", "identity")):
            if draw(st.integers(0, 9)) == 0:
                d[key] = default
    put("scale", draw(st.one_of(st.just("auto"), st.integers(1, 10**6),
                                st.floats(min_value=1e-300, max_value=SCALE_MAX))), "auto")
    return d


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(legal_spec_dicts())
def test_legal_specs_load(d):
    spec = load_spec(d)
    assert spec.name == d["name"] and spec.attention == d["attention"]
    given_fields = ("qk_norm", "update", "decay", "normalize", "mask", "window") if spec.is_linear \
        else ("decay", "mask", "window")
    for key in given_fields:
        if key in d:
            assert getattr(spec, key) == d[key]
    fm = d.get("feature_map", "identity") if spec.is_linear else "identity"
    if isinstance(fm, dict):
        assert (spec.feature_map, spec.feature_expr) == ("expr", fm["expr"])
    else:
        assert spec.feature_map == fm
    if fm == "favor_plus":
        assert dataclasses.asdict(spec.favor_plus) == {"features": 64, "orthogonal": True, "seed": 0,
                                                       **d.get("favor_plus", {})}
    else:
        assert spec.favor_plus is None
    scale = d.get("scale", "auto")
    assert spec.scale == (None if scale == "auto" else float(scale))
    if isinstance(scale, (int, float)):
        assert math.isfinite(spec.scale) and spec.scale > 0
    # Canonical form: stable round trip, through a dict and through YAML.
    assert load_spec(spec.to_dict()) == spec
    assert load_spec(spec.to_dict()).hash == spec.hash
    assert parse_spec(yaml.safe_dump(d), "legal.yaml") == spec
    assert spec.describe()


# --------------------------------------------------------------------------- bounds (issue 15, item 10)

def test_bounds_are_in_the_schema():
    """Every integer field declares its range, the name its length, and the spec its size."""
    fields = schema()["fields"]
    for info in (fields["window"], *fields["favor_plus"]["fields"].values()):
        if info["type"] == "int":
            assert {"min", "max"} <= set(info), info
    assert fields["window"]["max"] + (2**30 - 1) <= 2**31 - 1   # position + window stays in int32
    assert fields["name"]["max_length"] == 64
    assert schema()["limits"]["spec_bytes"] == 65536


def test_limits_hold_at_their_edges():
    top = schema()["fields"]["window"]["max"]
    assert parse_spec(y(*SOFT, "mask: sliding_window", f"window: {top}"), "ok.yaml").window == top
    assert parse_spec(y("name: " + "a" * 64, "attention: linear"), "ok.yaml").name == "a" * 64
    seed = schema()["fields"]["favor_plus"]["fields"]["seed"]["max"]
    assert parse_spec(y(*FAVOR, f"  seed: {seed}"), "ok.yaml").favor_plus.seed == seed
    with pytest.raises(SpecError, match="at most 64 characters"):
        parse_spec(y("name: " + "a" * 65, "attention: linear"), "bad.yaml")
    with pytest.raises(SpecError, match=f"from 0 to {seed}"):
        parse_spec(y(*FAVOR, f"  seed: {seed + 1}"), "bad.yaml")
    # exp(-exp(-...)): a tower of exp overflows float64 (refused as not finite)
    nested = "exp(-" * 10 + "x" + ")" * 10
    assert parse_spec(y(*EXPR, f"  expr: {nested}"), "ok.yaml").feature_expr == nested


def test_large_spec_file_is_refused_before_parsing(tmp_path):
    """A 52 MB file (sparse: no disk used) is refused by its size, naming the file, the size and the
    limit; a device that says size 0 is read no further than the limit."""
    path = tmp_path / "huge.yaml"
    with open(path, "wb") as f:
        f.write(y(*LIN).encode())
        f.truncate(52_000_000)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value) == f"{path}: the spec file is 52000000 bytes; a spec is at most 65536 bytes"
    with pytest.raises(SpecError, match="more than 65536 bytes"):
        load_spec("/dev/zero")


def test_product_of_piecewise_maps_loads_quickly():
    """A product of 8 Piecewise maps (263 characters) took 259 s in piecewise_fold; the fold is
    skipped beyond a few pieces. Run in a subprocess so that a regression fails, not hangs."""
    expr = "*".join(f"Piecewise((x+{i}, x > {i}), (exp(x), True))" for i in range(8))
    code = ("import sys; from attngen.spec import parse_spec; "
            f"s = parse_spec('name: a\\nattention: linear\\nfeature_map: {{expr: \"{expr}\"}}\\n'); "
            "print(s.feature_map)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "expr"


@pytest.mark.parametrize("expr", [
    "Max(" + ",".join(f"{i}*x+{i}" for i in range(7)) + ",Min(" + ",".join(f"{i}*x-{i}" for i in range(8)) + "))",
    "exp(-" * 10 + "x" + ")" * 10,
    "*".join(f"Piecewise((x+{i}, x > {i}), (sin(x), True))" for i in range(12)),
])
def test_expressions_within_the_limits_load_quickly(expr):
    start = time.perf_counter()
    spec = parse_spec(y(*EXPR, f"  expr: '{expr}'"), "ok.yaml")
    assert spec.feature_expr == expr
    assert time.perf_counter() - start < 20


def test_recursion_error_becomes_a_spec_error(monkeypatch):
    """Whatever still recurses too deeply inside sympy is a located SpecError, not a traceback."""
    from attngen import algebra

    def deep(expr):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(algebra, "derivative", deep)
    with pytest.raises(SpecError, match=r"bad\.yaml:4: field 'feature_map\.expr': value 'exp\(x\)' is too deeply"):
        parse_spec(y(*EXPR, "  expr: exp(x)"), "bad.yaml")


# --------------------------------------------------------------------------- did you mean (issue 15, item 5)

@pytest.mark.parametrize("text, field, hint", [
    (y(*LIN, "updte: delta"), "updte", "did you mean 'update'?"),
    (y(*LIN, "decay: scaler"), "decay", "did you mean 'scalar'?"),
    (y(*LIN, "feature_map: elu_plus_1"), "feature_map", "did you mean 'elu_plus_one'?"),
    (y(*LIN, "mask: bidirectonal"), "mask", "did you mean 'bidirectional'?"),
    (y("name: a", "atention: linear"), "atention", "did you mean 'attention'?"),
    (y("name: a", "attention: softmx"), "attention", "did you mean 'softmax'?"),
    (y(*FAVOR, "  sed: 3"), "favor_plus.sed", "did you mean 'seed'?"),
    (y(*SOFT, "decay: scalr"), "decay", "did you mean 'scalar'?"),
])
def test_did_you_mean(text, field, hint):
    with pytest.raises(SpecError) as info:
        parse_spec(text, "typo.yaml")
    assert info.value.field == field
    assert hint in str(info.value) and "allowed" in str(info.value)


def test_no_suggestion_for_unrelated_words():
    with pytest.raises(SpecError) as info:
        parse_spec(y(*LIN, "colour: red"), "bad.yaml")
    assert "did you mean" not in str(info.value)


def test_field_rules_come_from_the_schema(monkeypatch):
    """required, only_for and only_with are read from schema.yaml, not re-coded in spec.py: a rule
    added to the schema takes effect."""
    import copy

    from attngen import spec as spec_module
    changed = copy.deepcopy(spec_module.schema())
    changed["fields"]["scale"]["only_with"] = {"mask": "causal"}
    changed["fields"]["mask"]["only_for"] = "linear"
    changed["fields"]["mask"]["default"] = None
    changed["fields"]["decay"]["required"] = True
    monkeypatch.setattr(spec_module, "schema", lambda: changed)
    with pytest.raises(SpecError, match="decay.*required"):
        load_spec({"name": "x", "attention": "linear"})
    with pytest.raises(SpecError, match="scale.*only allowed with mask: causal"):
        load_spec({"name": "x", "attention": "linear", "decay": "none", "mask": "bidirectional", "scale": 0.5})
    with pytest.raises(SpecError, match="mask.*only for attention: linear"):
        load_spec({"name": "x", "attention": "softmax", "decay": "none", "mask": "causal"})


def test_every_update_rule_of_the_schema_has_its_facts():
    """spec.RULES holds what the rest of attngen reads of a rule (its input beta, its FLOPs, whether the UT
    transform lowers it, where it is legal): one entry per rule the schema allows, and the legality errors
    name the rules that are allowed."""
    from attngen.spec import RULES
    assert set(RULES) == set(schema()["fields"]["update"]["allowed"])
    assert [n for n, r in RULES.items() if r.bidirectional] == ["additive"]
    with pytest.raises(SpecError, match="not allowed with mask: bidirectional; allowed: additive"):
        parse_spec(y(*LIN, "update: delta", "mask: bidirectional"), "bad.yaml")
    for name, rule in RULES.items():
        spec = load_spec({"name": "s", "attention": "linear", "update": name})
        assert spec.rule is rule and rule.formula in spec.describe()
