"""The runtime contract (DESIGN.md §2): bad input raises ValueError naming the argument,
load caching, FAVOR+ random features, ATTNGEN_BACKEND, low-precision dtypes."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import attngen
from attngen.runtime import check_call
from attngen.testing import Shape, compare, random_inputs

from specs import SHIPPED

B, T, H, K, V = 2, 10, 3, 4, 5
SHAPE = Shape(batch=B, q_len=T, heads=H, head_dim=K, value_dim=V)


def op_and_inputs(name: str, shape: Shape = SHAPE, **kw):
    op = attngen.load(SHIPPED[name])
    return op, random_inputs(op.spec, shape, seed=0, **kw)


def raises_naming(arg: str, *also: str):
    """pytest.raises(ValueError) whose message is "<arguments>: ..." with `arg` among the
    arguments, and holds each of `also`."""
    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(ValueError)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.ctx.__exit__(*exc)
            msg = str(self.info.value)
            named = re.split(r",\s*", msg.split(":", 1)[0])
            assert arg in named, f"message does not name {arg!r}: {msg}"
            for text in also:
                assert text in msg, f"message lacks {text!r}: {msg}"
            return handled
    return _Check()


# --------------------------------------------------------------------------- bad input

def drop(name):
    return lambda a: {n: t for n, t in a.items() if n != name}


def put(name, fn):
    return lambda a: {**a, name: fn(a)}


BAD_LINEAR = [
    # (id, spec, edit of the valid inputs, argument named, text the message must also hold)
    ("q_rank", "gated_deltanet", put("q", lambda a: a["q"][0]), "q", "[B, T, H, K]"),
    ("k_rank", "gated_deltanet", put("k", lambda a: a["k"][..., None]), "k", "[B, T, H, K]"),
    ("v_rank", "gated_deltanet", put("v", lambda a: a["v"].flatten(2)), "v", "[B, T, HV, V]"),
    ("q_not_tensor", "gated_deltanet", put("q", lambda a: a["q"].tolist()), "q", "tensor"),
    ("q_int_dtype", "mamba2", put("q", lambda a: a["q"].long()), "q", "floating"),
    ("k_shape", "gated_deltanet", put("k", lambda a: a["k"][:, :-1]), "k", "[B, T, H, K]"),
    ("k_head_dim", "mamba2", put("k", lambda a: a["k"][..., :-1]), "k", "[B, T, H, K]"),
    ("v_time", "gated_deltanet", put("v", lambda a: a["v"][:, 1:]), "v", "[B, T, HV, V]"),
    ("v_heads", "mamba2", put("v", lambda a: a["v"][:, :, :1]), "v", "must be a multiple of the query / key heads"),
    ("k_dtype", "gated_deltanet", put("k", lambda a: a["k"].float()), "k", "dtype"),
    ("v_dtype", "mamba2", put("v", lambda a: a["v"].half()), "v", "dtype"),
    ("g_missing_scalar", "gated_deltanet", drop("g"), "g", "[B, T, HV]"),
    ("g_missing_vector", "gla", drop("g"), "g", "[B, T, HV, K]"),
    ("g_missing_constant", "retnet", drop("g"), "g", "[HV]"),
    ("g_for_decay_none", "deltanet", put("g", lambda a: torch.zeros(B, T, H, dtype=torch.float64)), "g", "none"),
    ("g_rank_scalar", "mamba2", put("g", lambda a: a["g"][..., None]), "g", "[B, T, HV]"),
    ("g_shape_vector", "gla", put("g", lambda a: a["g"][..., :-1]), "g", "[B, T, HV, K]"),
    ("g_shape_constant", "retnet", put("g", lambda a: a["g"][:-1]), "g", "[HV]"),
    ("beta_missing", "deltanet", drop("beta"), "beta", "[B, T, HV]"),
    ("beta_for_additive", "mamba2", put("beta", lambda a: torch.ones(B, T, H, dtype=torch.float64)), "beta",
     "additive"),
    ("beta_shape", "kda", put("beta", lambda a: a["beta"][:, :-1]), "beta", "[B, T, HV]"),
    ("initial_state_shape", "gated_deltanet", put("initial_state", lambda a: a["initial_state"][..., :-1]),
     "initial_state", "[N, HV, F, V]"),
    ("initial_state_rank", "gla", put("initial_state", lambda a: a["initial_state"][0]), "initial_state",
     "[N, HV, F, V]"),
    ("initial_state_batch", "mamba2", put("initial_state", lambda a: a["initial_state"][:1]), "initial_state",
     "[N, HV, F, V]"),
    ("initial_state_sum_without_z", "linear_transformer",
     put("initial_state", lambda a: a["initial_state"][..., :-1]), "initial_state", "V + 1"),
    ("initial_state_features", "performer", put("initial_state", lambda a: a["initial_state"][:, :, :K]),
     "initial_state", "[N, HV, F, V]"),
    # one input head-first [B, H, T, D] among time-major ones: the error says so
    ("k_head_first", "gated_deltanet", put("k", lambda a: a["k"].transpose(1, 2)), "k",
     "looks head-first", "k.transpose(1, 2)"),
    ("v_head_first", "mamba2", put("v", lambda a: a["v"].transpose(1, 2)), "v", "looks head-first", "v.transpose(1, 2)"),
    ("g_head_first", "mamba2", put("g", lambda a: a["g"].transpose(1, 2)), "g", "looks head-first", "time-major"),
    ("g_vector_head_first", "gla", put("g", lambda a: a["g"].transpose(1, 2)), "g", "g.transpose(1, 2)"),
    ("beta_head_first", "deltanet", put("beta", lambda a: a["beta"].transpose(1, 2)), "beta", "looks head-first"),
]


@pytest.mark.parametrize("case", BAD_LINEAR, ids=[c[0] for c in BAD_LINEAR])
def test_bad_linear_input_names_the_argument(case):
    _, name, edit, arg, *text = case
    op, inputs = op_and_inputs(name)
    op(**inputs)  # the unedited call is valid
    with raises_naming(arg, *text):
        op(**edit(inputs))


@pytest.mark.parametrize("arg", ["k", "v"])
def test_softmax_head_first_hint(arg):
    op, inputs = op_and_inputs("softmax_causal", Shape(batch=B, q_len=T, heads=4, head_dim=K, value_dim=V))
    op(**inputs)
    bad = {n: t.transpose(1, 2) if n == arg else t for n, t in inputs.items()}
    with raises_naming(arg, "looks head-first"):
        op(**bad)


PACKED = Shape(batch=1, q_len=12, heads=2, head_dim=K, value_dim=V, cu_seqlens=(0, 5, 6, 12))
BAD_CU = [
    ("non_monotone", lambda a: torch.tensor([0, 6, 5, 12]), "cu_seqlens", "increasing"),
    ("repeated_offset", lambda a: torch.tensor([0, 5, 5, 12]), "cu_seqlens", "increasing"),
    ("short_of_T", lambda a: torch.tensor([0, 5, 11]), "cu_seqlens", "T = 12"),
    ("past_T", lambda a: torch.tensor([0, 5, 13]), "cu_seqlens", "T = 12"),
    ("not_from_zero", lambda a: torch.tensor([1, 5, 12]), "cu_seqlens", "start at 0"),
    ("float", lambda a: torch.tensor([0.0, 5.0, 12.0]), "cu_seqlens", "integer"),
    ("int16", lambda a: torch.tensor([0, 5, 12], dtype=torch.int16), "cu_seqlens", "int32 or int64"),
    ("bool", lambda a: torch.tensor([False, True]), "cu_seqlens", "int32 or int64"),
    ("two_dims", lambda a: torch.tensor([[0, 5, 12]]), "cu_seqlens", "1-D"),
    ("one_entry", lambda a: torch.tensor([0]), "cu_seqlens", "2 entries"),
]


@pytest.mark.parametrize("name", ["gated_deltanet", "softmax_causal"])
@pytest.mark.parametrize("case", BAD_CU, ids=[c[0] for c in BAD_CU])
def test_bad_cu_seqlens(name, case):
    _, make, arg, text = case
    op = attngen.load(SHIPPED[name])
    inputs = random_inputs(op.spec, PACKED, seed=0, initial_state=False)
    op(**inputs)
    with raises_naming(arg, text):
        op(**{**inputs, "cu_seqlens": make(inputs)})


@pytest.mark.parametrize("name", ["gated_deltanet", "softmax_causal"])
def test_cu_seqlens_with_batch_two(name):
    op, inputs = op_and_inputs(name, initial_state=False)
    with raises_naming("cu_seqlens", "batch size 1"):
        op(**inputs, cu_seqlens=torch.tensor([0, 4, T]))


def test_initial_state_per_packed_sequence():
    """With cu_seqlens, N is the number of sequences, not the batch."""
    op = attngen.load("specs/gated_deltanet.yaml")
    inputs = random_inputs(op.spec, PACKED, seed=0)
    op(**inputs)
    with raises_naming("initial_state", "[N, HV, F, V]"):
        op(**{**inputs, "initial_state": inputs["initial_state"][:2]})


def test_softmax_more_queries_than_keys():
    op, inputs = op_and_inputs("softmax_causal", Shape(batch=B, q_len=8, heads=H, head_dim=K, value_dim=V, k_len=8))
    with raises_naming("q", "Tq <= Tk"):
        op(**{**inputs, "k": inputs["k"][:, :5], "v": inputs["v"][:, :5]})


@pytest.mark.parametrize("kv_heads", [4, 5])
def test_softmax_kv_heads_must_divide_heads(kv_heads):
    op, inputs = op_and_inputs("softmax_causal", Shape(batch=B, q_len=T, heads=6, head_dim=K, value_dim=V))
    with raises_naming("k", "H_kv = %d" % kv_heads, "divide"):
        op(**{**inputs, "k": inputs["k"][:, :, :kv_heads], "v": inputs["v"][:, :, :kv_heads]})


def test_softmax_v_heads_follow_k():
    op, inputs = op_and_inputs("softmax_causal", Shape(batch=B, q_len=T, heads=6, head_dim=K, value_dim=V))
    with raises_naming("v", "H_kv"):
        op(**{**inputs, "k": inputs["k"][:, :, :2], "v": inputs["v"][:, :, :3]})


@pytest.mark.parametrize("name", ["softmax_causal", "sliding_window", "forgetting_attention", "softmax_bidirectional"])
def test_grouped_query_heads_on_the_pytorch_form(name):
    """Grouped-query attention (H = 6 over H_kv = 2, and MQA) on the PyTorch form: outputs and
    gradients against the oracle."""
    for kv_heads in (1, 2):
        op, inputs = op_and_inputs(name, Shape(batch=B, q_len=9, k_len=13, heads=6, kv_heads=kv_heads, head_dim=K,
                                               value_dim=V))
        bad = [(n, e, t) for n, e, t in compare(op.spec, lambda **kw: op(**kw), inputs, torch.float32)
               if not e <= t]
        assert not bad, bad


def test_softmax_packed_needs_equal_lengths():
    op, inputs = op_and_inputs("softmax_causal", Shape(batch=1, q_len=6, heads=H, head_dim=K, value_dim=V, k_len=9))
    with raises_naming("cu_seqlens", "Tq == Tk"):
        op(**inputs, cu_seqlens=torch.tensor([0, 4, 9]))


@pytest.mark.parametrize("arg,value", [("beta", "ones"), ("initial_state", "zeros"), ("output_final_state", True)])
def test_softmax_rejects_linear_arguments(arg, value):
    op, inputs = op_and_inputs("forgetting_attention")
    extra = {"ones": torch.ones(B, T, H, dtype=torch.float64), "zeros": torch.zeros(B, H, K, V)}.get(value, value)
    with raises_naming(arg):
        op(**inputs, **{arg: extra})


@pytest.mark.parametrize("name", ["forgetting_attention", "softmax_causal"])
def test_softmax_g_presence(name):
    op, inputs = op_and_inputs(name)
    if op.spec.decay == "scalar":
        with raises_naming("g", "[B, Tk, H]"):
            op(**drop("g")(inputs))
        with raises_naming("g", "[B, Tk, H]"):
            op(**{**inputs, "g": inputs["g"][:, 1:]})
    else:
        with raises_naming("g", "none"):
            op(**inputs, g=torch.zeros(B, T, H, dtype=torch.float64))


@pytest.mark.parametrize("name", ["gated_deltanet", "softmax_causal"])
@pytest.mark.parametrize("scale", [0, -1, 0.0, -0.5, float("inf"), float("nan"), "a", True, "auto", 1e39,
                                   pytest.param(10 ** 400, id="int_past_float")])
def test_bad_scale(name, scale):
    op, inputs = op_and_inputs(name)
    with raises_naming("scale"):
        op(**inputs, scale=scale)


@pytest.mark.parametrize("flag", ["yes", 1, None, torch.tensor(True)])
def test_bad_output_final_state(flag):
    """output_final_state is True or False: a truthy string or number is not taken as one."""
    op, inputs = op_and_inputs("gated_deltanet")
    with raises_naming("output_final_state", repr(flag)):
        op(**inputs, output_final_state=flag)


def test_good_scale_is_used():
    op, inputs = op_and_inputs("softmax_causal")
    assert not torch.equal(op(**inputs, scale=0.5), op(**inputs, scale=2))
    assert torch.equal(op(**inputs, scale=K ** -0.5), op(**inputs))


@pytest.mark.parametrize("name,form", [("gated_deltanet", "nonsense"), ("gated_deltanet", "Chunked"),
                                       ("softmax_causal", "recurrent"), ("linear_bidirectional", "chunked")])
def test_bad_form(name, form):
    op, inputs = op_and_inputs(name)
    with raises_naming("form", form):
        op(**inputs, form=form)


@pytest.mark.parametrize("chunk", [3, 0, 512, -16, 2.0, True])
def test_bad_chunk_size(chunk):
    op, inputs = op_and_inputs("gated_deltanet")
    with raises_naming("chunk_size"):
        op(**inputs, form="chunked", chunk_size=chunk)


@pytest.mark.parametrize("name,form", [("gated_deltanet", "recurrent"), ("gated_deltanet", "parallel"),
                                       ("softmax_causal", None), ("linear_bidirectional", None)])
def test_chunk_size_of_another_form(name, form):
    """A chunk size with a form other than chunked, or on a spec without one, is an error, not ignored."""
    op, inputs = op_and_inputs(name)
    with raises_naming("chunk_size", "chunked form only"):
        op(**inputs, form=form, chunk_size=16)


def test_chunk_size_asks_for_the_chunked_form():
    op, inputs = op_and_inputs("gated_deltanet")
    call = check_call(op, inputs)
    assert op.choose(call).form != "chunked"  # a short call: the planner's pick is another form
    choice = op.choose(call, chunk_size=16)
    assert (choice.form, choice.chunk) == ("chunked", 16) and "chunk_size" in choice.reason
    torch.testing.assert_close(op(**inputs, chunk_size=16), op(**inputs, form="chunked", chunk_size=16))


def _devices():
    """A second device for mismatch checks: meta always exists (the checks never compute)."""
    out = ["meta"]
    if torch.cuda.is_available():
        out.append("cuda")
    return out


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("arg", ["k", "v", "g", "beta", "initial_state", "cu_seqlens"])
def test_device_mismatch(arg, device):
    op = attngen.load("specs/gated_deltanet.yaml")
    inputs = random_inputs(op.spec, PACKED, seed=0)
    op(**inputs)
    with raises_naming(arg, "device"):
        op(**{**inputs, arg: inputs[arg].to(device)})


# --------------------------------------------------------------------------- load, features, backend

def test_load_is_cached():
    spec = {"name": "cached", "attention": "linear", "update": "delta", "qk_norm": "l2", "decay": "scalar"}
    op = attngen.load(spec)
    assert attngen.load(spec) is op
    assert attngen.load(dict(spec)) is op
    assert attngen.load(attngen.load_spec(spec)) is op
    assert attngen.load({**spec, "decay": "vector"}) is not op
    from_file = attngen.load("specs/gated_deltanet.yaml")
    assert attngen.load("specs/gated_deltanet.yaml") is from_file
    assert attngen.load(from_file.spec.to_dict()) is from_file


FAVOR = {"name": "favor", "attention": "linear", "feature_map": "favor_plus",
         "favor_plus": {"features": 24, "orthogonal": True, "seed": 7}, "normalize": "sum"}


@pytest.mark.parametrize("orthogonal", [True, False])
@pytest.mark.parametrize("head_dim", [1, 5, 16, 40])
def test_random_features_shape_and_determinism(orthogonal, head_dim):
    spec = {**FAVOR, "favor_plus": {**FAVOR["favor_plus"], "orthogonal": orthogonal}}
    omega = attngen.load(spec).random_features(head_dim)
    assert omega.shape == (24, head_dim) and omega.dtype == torch.float64 and omega.device.type == "cpu"
    assert torch.isfinite(omega).all()
    assert torch.equal(attngen.load(spec).random_features(head_dim), omega)
    # A new op of an equal spec (not the cached one) draws the same features.
    assert torch.equal(attngen.Op(attngen.load_spec(spec)).random_features(head_dim), omega)
    other = {**spec, "favor_plus": {**spec["favor_plus"], "seed": 8}}
    assert not torch.equal(attngen.load(other).random_features(head_dim), omega)


def test_random_features_identical_in_another_process():
    omega = attngen.load("specs/performer.yaml").random_features(16)
    code = ("import attngen, torch; o = attngen.load('specs/performer.yaml').random_features(16);"
            "print(repr(o.flatten().tolist()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert torch.equal(torch.tensor(eval(out.stdout), dtype=torch.float64).reshape(64, 16), omega)


@pytest.mark.parametrize("name", ["gated_deltanet", "linear_transformer", "softmax_causal"])
def test_random_features_of_non_favor_spec(name):
    with raises_naming("random_features", "favor_plus"):
        attngen.load(SHIPPED[name]).random_features(K)


@pytest.mark.parametrize("head_dim", [0, -3, 2.0, True])
def test_random_features_bad_head_dim(head_dim):
    with raises_naming("head_dim"):
        attngen.load("specs/performer.yaml").random_features(head_dim)


@pytest.mark.parametrize("name", ["gated_deltanet", "softmax_causal"])
def test_backend_env_nonsense(monkeypatch, name):
    op, inputs = op_and_inputs(name)
    monkeypatch.setenv("ATTNGEN_BACKEND", "nonsense")
    with raises_naming("ATTNGEN_BACKEND", "nonsense"):
        op(**inputs)


@pytest.mark.parametrize("value", ["auto", "torch"])
def test_backend_env_torch_and_auto_run(monkeypatch, value):
    op, inputs = op_and_inputs("gated_deltanet")
    want, _ = op(**inputs)
    monkeypatch.setenv("ATTNGEN_BACKEND", value)
    got, _ = op(**inputs)
    assert torch.equal(got, want)


def test_route_float64_inputs(monkeypatch):
    """One contract on every backend: float64 inputs of linear specs run the PyTorch forms (the
    linear kernels compute in float32), with the reason; the softmax kernels accumulate float64
    in float64 and keep them; other dtypes follow ATTNGEN_BACKEND."""
    from attngen.runtime import FLOAT64_REASON, route
    linear, softmax = attngen.load_spec("specs/gla.yaml"), attngen.load_spec("specs/softmax_causal.yaml")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("ATTNGEN_BACKEND", "triton")
    for device in ("cpu", "cuda"):
        assert route(linear, device, torch.float64) == ("torch", FLOAT64_REASON)
        assert route(softmax, device, torch.float64)[0] == "triton"
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert route(linear, device, dtype)[0] == "triton"
    monkeypatch.setenv("ATTNGEN_BACKEND", "auto")
    assert route(linear, "cuda", torch.float32)[0] == "triton"
    # causal FAVOR+ in bf16 at head dims up to 32: the PyTorch forms on CUDA (the kernels miscompiled),
    # the kernels at wider heads, in other dtypes, bidirectional, and in the interpreter
    from attngen.runtime import FAVOR_BF16_REASON
    performer = attngen.load_spec("specs/performer.yaml")
    assert route(performer, "cuda", torch.bfloat16, 32) == ("torch", FAVOR_BF16_REASON)
    assert route(performer, "cuda", torch.bfloat16, 16) == ("torch", FAVOR_BF16_REASON)
    assert route(performer, "cuda", torch.bfloat16, 64)[0] == "triton"
    assert route(performer, "cuda", torch.float16, 32)[0] == "triton"
    assert route(performer, "cuda", torch.bfloat16)[0] == "triton"
    assert route(attngen.load_spec("specs/performer_bidirectional.yaml"), "cuda", torch.bfloat16, 32)[0] == "triton"
    assert route(linear, "cuda", torch.bfloat16, 32)[0] == "triton"
    monkeypatch.setenv("ATTNGEN_BACKEND", "triton")
    assert route(performer, "cpu", torch.bfloat16, 32)[0] == "triton"
    monkeypatch.setenv("ATTNGEN_BACKEND", "auto")
    assert route(linear, "cuda", torch.float64) == ("torch", FLOAT64_REASON)
    assert route(linear, "cpu", torch.float32)[0] == "torch"
    monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
    assert route(softmax, "cuda", torch.float32) == ("torch", "ATTNGEN_BACKEND=torch")
    monkeypatch.setenv("ATTNGEN_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"ATTNGEN_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1"):
        route(linear, "cpu", torch.float32)


@pytest.mark.parametrize("name", ["gated_deltanet", "performer", "linear_bidirectional", "forgetting_attention"])
def test_meta_tensors_on_the_kernels_backend(triton_backend, name):
    """Meta tensors (shapes without data: a model built on the meta device) run the PyTorch forms
    on ATTNGEN_BACKEND=triton too, as on auto: outputs of the right shapes on the meta device, where
    the kernels would have read their (absent) data."""
    op, inputs = op_and_inputs(name, Shape(batch=1, q_len=16, heads=2, head_dim=16, value_dim=16),
                               dtype=torch.float32)
    want = op(**inputs)
    got = op(**{n: t.to("meta") for n, t in inputs.items()})
    for w, o in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        assert (o is None) == (w is None)
        if o is not None:
            assert o.device.type == "meta" and o.shape == w.shape and o.dtype == w.dtype


# --------------------------------------------------------------------------- dtypes

LOWP_SPECS = ["gated_deltanet", "gla", "linear_transformer", "performer", "retnet", "softmax_causal",
              "forgetting_attention", "sliding_window"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", LOWP_SPECS)
def test_low_precision_dtypes(name, dtype):
    """Outputs come back in the inputs' dtype, final states in float32, within tolerance of
    the float64 interpreter (relative to the interpreter run in that dtype)."""
    op = attngen.load(SHIPPED[name])
    inputs = random_inputs(op.spec, Shape(batch=2, q_len=40, heads=2, head_dim=8, value_dim=6), seed=2)
    low = {n: (t.to(dtype) if n in ("q", "k", "v") else t.float() if t.is_floating_point() else t)
           for n, t in inputs.items()}
    for form in [f.name for f in op.plan.forms]:
        if op.spec.is_linear:
            o, s = op(**low, output_final_state=True, form=form)
            assert s.dtype == torch.float32 and torch.isfinite(s).all()
            assert op(**low, form=form)[1] is None
        else:
            o = op(**low, form=form)
        assert o.dtype == dtype and o.shape == (2, 40, 2, 6) and torch.isfinite(o).all()
    bad = [r for r in compare(op.spec, op, inputs, dtype) if not r[1] <= r[2]]
    assert not bad, bad


# --------------------------------------------------------------------------- ATTNGEN_VALIDATE

def _set(name, index, value):
    def edit(a):
        t = a[name].clone()
        t[index] = value
        return {**a, name: t}
    return edit


BAD_VALUES = [
    # (id, spec, edit of the valid inputs, argument named, text the message must also hold)
    ("g_positive", "gated_deltanet", _set("g", (1, 4, 2), 0.37), "g",
     "log decay must be <= 0 (a gate exp(g) <= 1); got max 0.37 at [1, 4, 2]"),
    ("g_positive_constant", "retnet", _set("g", (1,), 0.5), "g", "got max 0.5 at [1]"),
    ("g_positive_softmax", "forgetting_attention", _set("g", (0, 3, 1), 2.0), "g", "at [0, 3, 1]"),
    ("g_nan", "mamba2", _set("g", (0, 2, 1), float("nan")), "g", "nan at [0, 2, 1]"),
    ("g_plus_inf", "mamba2", _set("g", (0, 2, 1), float("inf")), "g", "inf at [0, 2, 1]"),
    ("q_nan", "gated_deltanet", _set("q", (0, 1, 2, 3), float("nan")), "q", "nan at [0, 1, 2, 3]"),
    ("k_inf", "linear_transformer", _set("k", (1, 0, 0, 0), float("-inf")), "k", "-inf at [1, 0, 0, 0]"),
    ("v_nan", "softmax_causal", _set("v", (0, 0, 0, 1), float("nan")), "v", "finite"),
    ("beta_nan", "deltanet", _set("beta", (0, 5, 1), float("nan")), "beta", "nan at [0, 5, 1]"),
    ("beta_negative", "deltanet", _set("beta", (0, 5, 1), -0.1), "beta", "[0, 2]"),
    ("beta_above_two", "gated_deltanet", _set("beta", (1, 9, 0), 2.5), "beta", "got 2.5 at [1, 9, 0]"),
    ("initial_state_nan", "gated_deltanet", _set("initial_state", (0, 0, 0, 0), float("nan")), "initial_state",
     "nan"),
]


@pytest.mark.parametrize("case", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_validate_names_the_bad_value(monkeypatch, case):
    _, name, edit, arg, text = case
    op, inputs = op_and_inputs(name)
    bad = edit(inputs)
    op(**bad)   # off by default: no check, no sync
    monkeypatch.setenv("ATTNGEN_VALIDATE", "1")
    op(**inputs)
    with raises_naming(arg, text):
        op(**bad)


def test_validate_allows_resets_and_the_beta_range(monkeypatch):
    """g = -inf (a gate of exactly 0), g = 0 and beta at 0 and 2 are legal; just past them is not."""
    monkeypatch.setenv("ATTNGEN_VALIDATE", "1")
    op, inputs = op_and_inputs("gated_deltanet")
    inputs = _set("g", (0, 3, 1), float("-inf"))(_set("g", (0, 4, 1), 0.0)(inputs))
    inputs = _set("beta", (0, 2, 0), 0.0)(_set("beta", (1, 2, 0), 2.0)(inputs))
    op(**inputs)
    with raises_naming("g", "got max 0.001 at [0, 4, 1]"):
        op(**_set("g", (0, 4, 1), 1e-3)(inputs))
    with raises_naming("beta", "got 2.001 at [1, 2, 0]"):
        op(**_set("beta", (1, 2, 0), 2.001)(inputs))


def test_validate_env_nonsense(monkeypatch):
    op, inputs = op_and_inputs("mamba2")
    monkeypatch.setenv("ATTNGEN_VALIDATE", "yes")
    with raises_naming("ATTNGEN_VALIDATE", "'yes'"):
        op(**inputs)


# --------------------------------------------------------------------------- double backward

@pytest.mark.parametrize("name", ["mamba2", "linear_bidirectional", "softmax_causal"])
def test_double_backward_through_kernels_names_the_op(triton_backend, name):
    """Generated backward kernels (mamba2, softmax) and the recomputed PyTorch fallback
    (bidirectional): create_graph=True gives the first-order gradients; differentiating them
    again raises attngen's error, naming the op and the way out."""
    op = attngen.load(SHIPPED[name])
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=8, heads=2, head_dim=16, value_dim=16), seed=0,
                           dtype=torch.float32, initial_state=False)
    q = inputs["q"].requires_grad_(True)
    out = op(**inputs)
    o = out[0] if isinstance(out, tuple) else out
    (plain,) = torch.autograd.grad(o.square().sum(), q, retain_graph=True)
    (dq,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)
    assert torch.equal(dq.detach(), plain)
    with pytest.raises(RuntimeError, match=rf"attngen op '{name}': double backward.*ATTNGEN_BACKEND=torch"):
        dq.sum().backward()


# --------------------------------------------------------------------------- CUDA tensors without CUDA

class _ClaimsCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device: what the input checks see of a CUDA tensor on a
    machine whose torch cannot run it (one cannot be made there)."""

    @property
    def device(self):
        return torch.device("cuda", 0)


@pytest.mark.parametrize("cuda_build", [None, "12.8"])
@pytest.mark.parametrize("name", ["mamba2", "softmax_causal"])
def test_cuda_tensor_without_cuda(monkeypatch, name, cuda_build):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    op, inputs = op_and_inputs(name)
    q = torch.Tensor._make_subclass(_ClaimsCuda, inputs["q"])
    assert q.device.type == "cuda"
    why = "no CUDA support (torch.version.cuda is None)" if cuda_build is None else "torch.cuda.is_available()"
    with raises_naming("q", "a CUDA tensor", why):
        op(**{**inputs, "q": q})


# --------------------------------------------------------------------------- the eager path past the dispatcher

def test_eager_calls_skip_the_registered_op_and_others_go_through_it(triton_backend, monkeypatch):
    """A kernels' call with no autograd to record, nothing tracing or intercepting it and plain
    tensors calls the generated forward directly (runtime.eager: the dispatcher's pass over the op
    was half a decode call's host time); its outputs equal those through the op. A dispatch mode
    (here one that lists the ops it sees) and a tensor needing a gradient take the registered op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from attngen import runtime

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    plain = torch.zeros(2)
    assert runtime.eager(plain, None)
    wanting = torch.zeros(2, requires_grad=True)
    assert not runtime.eager(plain, wanting)
    with torch.no_grad():
        assert runtime.eager(plain, wanting)
    for name in ("softmax_causal", "mamba2"):
        # (float32: float64 inputs of linear specs run the PyTorch forms)
        op, inputs = op_and_inputs(name, dtype=torch.float32)
        module = runtime.kernels_for(op)
        with torch.no_grad(), monkeypatch.context() as patch:
            # the registered op is not called
            patch.setattr(module, "op", lambda *args: pytest.fail("an eager call went through the registered op"))
            direct = op(**inputs)
        with torch.no_grad():
            with Seen() as seen:
                through = op(**inputs)
        assert any(f"attngen.{name}" in s for s in seen.ops), (name, seen.ops[:5])
        first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
        assert torch.equal(first(direct), first(through))
        q = inputs["q"].clone().requires_grad_()
        graded = first(op(**{**inputs, "q": q}))
        assert graded.grad_fn is not None and torch.equal(graded.detach(), first(direct))
