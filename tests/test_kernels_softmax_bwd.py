"""The softmax backward kernels (FlashAttention-2 backward: delta preprocess, a dq kernel over
query blocks, a dk/dv kernel over key blocks) against float64 autograd through the interpreter,
through Triton's interpreter on the CPU (DESIGN.md §7): causal, bidirectional and
sliding-window masks, the scalar-decay bias (dg), Tq < Tk, K != V, varlen; every call checks
that the backward kernels ran (not the PyTorch fallback); gradients fully written; key and
query tiles outside the mask never read. Shapes are small: the interpreter is slow."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import attngen
from attngen import codegen
from attngen.testing import (LOWP_FLOOR, Shape, compare, kernel_launch, outputs_and_grads, random_inputs, rel_error,
                             tolerance)

from specs import SOFTMAX as SPECS


pytestmark = pytest.mark.usefixtures("triton_backend")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def kernel_module(op, monkeypatch):
    """The op's generated module, its softmax_bwd wrapped to count the launches of the backward
    kernels: the runtime would fall back to differentiating the PyTorch form without them."""
    module = codegen.load_module(op.spec)
    assert module.BACKWARD_FORMS == ("parallel",)
    real, calls = module.softmax_bwd, []

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(module, "softmax_bwd", counted)
    return module, calls


def one_key_per_query(spec, shape: Shape) -> bool:
    """Every query sees exactly one key (window 1, a single key, or packed sequences of one token
    each): the softmax weights are constant 1, so dq, dk and dg are exactly zero, and a relative
    error means nothing there."""
    cu = shape.cu_seqlens
    single = cu is not None and all(b - a == 1 for a, b in zip(cu, cu[1:]))
    return spec.window == 1 or (shape.k_len or shape.q_len) == 1 or single


def check_zero_by_structure(op, inputs, dtype, do_seed: int = 1) -> None:
    """dq, dk, dg of a one-key-per-query call are rounding noise of dS = P (dP - delta), each
    entry of size eps |do_t| |v_j|: bounded by the tolerance floor of `dtype` times the size their terms
    have (scale |dS| |k|, scale |dS| |q|, and |dS| summed along the sequence for dg)."""
    run = {n: (t.to(dtype) if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    got = outputs_and_grads(lambda **kw: op(**kw), op.spec, run, with_grads=True, seed=do_seed)
    do = torch.randn(got["o"].shape, generator=torch.Generator().manual_seed(do_seed), dtype=torch.float64)
    q, k, v = (run[n].double() for n in ("q", "k", "v"))
    ds = do.norm() * v.norm(dim=-1).max()
    scale = op.spec.default_scale(q.shape[-1])
    bounds = {"dq": scale * ds * k.norm(dim=-1).max(), "dk": scale * ds * q.norm(dim=-1).max(),
              "dg": ds * k.shape[1]}
    for name, bound in bounds.items():
        if name in got:
            err = float(got[name].double().norm())
            assert err <= tolerance(dtype, None) * float(bound), f"{name}: |{name}| = {err:.3g} on an exact zero"


def check(name: str, shape: Shape, dtype, monkeypatch, seed: int = 0, decay_strength: float = 1.0,
          lse: bool = False, outputs: dict | None = None) -> None:
    """lse: the op's log-sum-exp (return_lse) too, and the gradients of a loss on o and on it;
    outputs: a dict that receives the op's outputs and gradients (attngen.testing.compare)."""
    op = attngen.load(SPECS[name])
    _, calls = kernel_module(op, monkeypatch)
    inputs = random_inputs(op.spec, shape, seed=seed, decay_strength=decay_strength)
    rows = compare(op.spec, lambda **kw: op(**kw), inputs, dtype, with_grads=True, lse=lse, outputs=outputs)
    assert len(calls) == 1, "the backward kernels did not run"
    assert not lse or "lse" in {n for n, _, _ in rows}
    # one key per query: lse_t = s_tt, so a loss on it gives dq and dk; dg stays zero (the bias of a
    # query on its own key is 0)
    zero = ({"dg"} if lse else {"dq", "dk", "dg"}) if one_key_per_query(op.spec, shape) else set()
    failures = [f"{n}: error {e:.3g} > tolerance {t:.3g}" for n, e, t in rows if n not in zero and not e <= t]
    assert not failures, f"{name} {dtype} on {shape}:\n" + "\n".join(failures)
    if zero:
        check_zero_by_structure(op, inputs, dtype)


@pytest.mark.parametrize("T", [1, 7, 63, 100, 130])
@pytest.mark.parametrize("name", list(SPECS))
def test_masks_and_lengths(name, T, monkeypatch):
    """Every mask and the decay bias, float32; one partial block up to two, K != V."""
    check(name, Shape(batch=1, q_len=T, heads=2, head_dim=16, value_dim=24), torch.float32, monkeypatch, seed=T)


@pytest.mark.parametrize("T", [7, 130])
@pytest.mark.parametrize("name", list(SPECS))
def test_bfloat16(name, T, monkeypatch):
    check(name, Shape(batch=1, q_len=T, heads=1, head_dim=16, value_dim=24), torch.bfloat16, monkeypatch, seed=T)


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("Tq, Tk", [(1, 37), (5, 70)])
@pytest.mark.parametrize("name", list(SPECS))
def test_fewer_queries_than_keys(name, Tq, Tk, dname, monkeypatch):
    """Queries aligned to the end of the keys: keys no query sees get zero dk, dv (windows)."""
    check(name, Shape(batch=2, q_len=Tq, k_len=Tk, heads=1, head_dim=16, value_dim=16), DTYPES[dname],
          monkeypatch, seed=Tk)


@pytest.mark.parametrize("K, V", [(24, 40), (100, 8)])
@pytest.mark.parametrize("name", ["causal", "window3", "forgetting"])
def test_head_dims(name, K, V, monkeypatch):
    """K != V, dims that are not powers of two (masked lanes), below 16 (padded dot lanes)."""
    check(name, Shape(batch=1, q_len=70, heads=1, head_dim=K, value_dim=V), torch.float32, monkeypatch, seed=K + V)


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("name", list(SPECS))
def test_varlen(name, dname, monkeypatch):
    """Packed sequences: one of length 1, blocks that run past a sequence's end next to
    sequences shorter than a block; dg's reverse cumsum stays inside each sequence."""
    shape = Shape(batch=1, q_len=100, heads=1, head_dim=16, value_dim=8, cu_seqlens=(0, 1, 66, 83, 100))
    check(name, shape, DTYPES[dname], monkeypatch)


@pytest.mark.parametrize("name", ["forgetting", "window_decay"])
def test_strong_decay(name, monkeypatch):
    """g down to about -20 per token: the bias is exact to an ulp of itself, dg stays accurate."""
    shape = Shape(batch=1, q_len=130, heads=1, head_dim=16, value_dim=16)
    for dtype in DTYPES.values():
        check(name, shape, dtype, monkeypatch, decay_strength=20)
    check(name, Shape(batch=1, q_len=100, heads=1, head_dim=16, value_dim=16, cu_seqlens=(0, 1, 66, 100)),
          torch.float32, monkeypatch, decay_strength=20)


@pytest.mark.parametrize("name", ["causal", "forgetting"])
def test_float16(name, monkeypatch):
    check(name, Shape(batch=1, q_len=70, heads=2, head_dim=16, value_dim=24), torch.float16, monkeypatch)


@pytest.mark.parametrize("name", ["bidirectional", "window3", "window_decay"])
def test_float64(name, monkeypatch):
    """float64 inputs accumulate in float64, and the forward's lse is float64: agreement to the
    float64 tolerance, Tq < Tk and varlen."""
    check(name, Shape(batch=1, q_len=40, k_len=70, heads=2, head_dim=24, value_dim=8), torch.float64, monkeypatch)
    check(name, Shape(batch=1, q_len=70, heads=1, head_dim=24, value_dim=8, cu_seqlens=(0, 1, 50, 70)),
          torch.float64, monkeypatch)


@pytest.mark.parametrize("case", ["dense", "fewer_queries", "varlen", "bf16", "fp64"])
@pytest.mark.parametrize("name", list(SPECS))
def test_lse_and_its_gradient(name, case, monkeypatch):
    """return_lse: the log-sum-exp [B, Tq, H] against the oracle's, and the gradients of a loss on
    o and lse (the backward's delta less dlse) against float64 autograd of the oracle."""
    shape = {"dense": Shape(batch=2, q_len=70, heads=2, head_dim=16, value_dim=24),
             "fewer_queries": Shape(batch=2, q_len=5, k_len=70, heads=2, head_dim=16, value_dim=8),
             "varlen": Shape(batch=1, q_len=100, heads=2, head_dim=16, value_dim=8, cu_seqlens=(0, 1, 66, 83, 100)),
             "bf16": Shape(batch=1, q_len=40, k_len=70, heads=2, head_dim=16, value_dim=8),
             "fp64": Shape(batch=1, q_len=40, k_len=70, heads=2, head_dim=24, value_dim=8)}[case]
    dtype = {"bf16": torch.bfloat16, "fp64": torch.float64}.get(case, torch.float32)
    check(name, shape, dtype, monkeypatch, seed=7, lse=True)


def spy_kv_splits(module, monkeypatch) -> list:
    """The key splits the module's forward chooses, call by call (softmax_kv_split_len spied on)."""
    real, splits = module.softmax_kv_split_len, []

    def spied(*args):
        got = real(*args)
        splits.append(got[0])
        return got

    monkeypatch.setattr(module, "softmax_kv_split_len", spied)
    return splits


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("Tq, Tk, kv_heads", [(1, 300, 2), (3, 531, 1)])
@pytest.mark.parametrize("name", ["causal", "window16", "forgetting"])
def test_lse_split_kv_decode(name, Tq, Tk, kv_heads, dname, monkeypatch):
    """Decode with the keys split (flash-decoding): the lse the last split merges is the
    call's, and its gradient flows through the backward."""
    op = attngen.load(SPECS[name])
    splits = spy_kv_splits(codegen.load_module(op.spec), monkeypatch)
    shape = Shape(batch=2, q_len=Tq, k_len=Tk, heads=2 * kv_heads, kv_heads=kv_heads, head_dim=16, value_dim=8)
    check(name, shape, DTYPES[dname], monkeypatch, seed=Tk, lse=True)
    assert splits and max(splits) > 1, f"the keys were not split: {splits}"


def _grads(op, module, inputs, do, scale):
    """(o, dq, dk, dv, dg) of the module's forward and backward launchers, called directly."""
    q, k, v, g, cu = (inputs.get(n) for n in ("q", "k", "v", "g", "cu_seqlens"))
    launch = kernel_launch(op, inputs)[1]
    o, lse = module.forward(q, k, v, g, cu, scale, None, launch)
    return (o, *module.softmax_bwd(q, k, v, g, cu, scale, None, launch, o, lse, do)[:4])


@pytest.mark.parametrize("name, case", [("bidirectional", "dense"), ("window3", "varlen"), ("window_decay", "decode"),
                                        ("window_decay", "varlen")])
def test_gradients_fully_written(name, case, monkeypatch):
    """Gradient and scratch buffers allocated NaN-filled (as torch.empty's garbage may be): the
    kernels write every element of dq, dk, dv (keys no query sees included) and of delta, lse2
    and the dg partial sums, and give the same gradients as with clean buffers."""
    op = attngen.load(SPECS[name])
    module = codegen.load_module(op.spec)
    shape = {"dense": Shape(batch=2, q_len=70, heads=2, head_dim=24, value_dim=40),
             "varlen": Shape(batch=1, q_len=100, heads=1, head_dim=24, value_dim=40, cu_seqlens=(0, 1, 66, 83, 100)),
             "decode": Shape(batch=2, q_len=3, k_len=70, heads=2, head_dim=24, value_dim=40)}[case]
    inputs = random_inputs(op.spec, shape, dtype=torch.float32)
    do = torch.randn(shape.batch, shape.q_len, shape.heads, shape.value_dim, generator=torch.Generator().manual_seed(3))
    scale = op.spec.default_scale(shape.head_dim)
    clean = _grads(op, module, inputs, do, scale)
    real_new_empty = torch.Tensor.new_empty

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: poison(real_new_empty(self, *a, **kw)))
    assert torch.isnan(do.new_empty(2)).all()
    got = _grads(op, module, inputs, do, scale)
    for n, a, b in zip(("o", "dq", "dk", "dv", "dg"), got, clean):
        if b is not None:
            assert torch.isfinite(a).all(), f"{n}: an element was never written"
            assert torch.equal(a, b), f"{n}: differs from the run with clean buffers"


@pytest.mark.parametrize("name", ["causal", "window3", "window_decay"])
def test_masked_tiles_are_not_read(name):
    """NaN in inputs that a block cannot see: both backward loops must skip those tiles (a masked
    tile would still multiply the NaN by a zero weight, as the oracle does). Blocks are at most
    128 wide. Causal: query 0 is seen by key 0 alone, so dk, dv of keys from 128 never load it;
    the last key is seen by the last query alone, so dq of queries before 128 never loads it.
    Windows of <= 16: key 0 is never loaded for dq of queries from 128, the last query never for
    dk, dv of keys before 128."""
    op = attngen.load(SPECS[name])
    module = codegen.load_module(op.spec)
    T = 256
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=T, heads=1, head_dim=16, value_dim=16), dtype=torch.float32)
    do = torch.randn(1, T, 1, 16, generator=torch.Generator().manual_seed(3))
    scale = op.spec.default_scale(16)
    _, dq, dk, dv, _ = clean = _grads(op, module, inputs, do, scale)
    q, k, v, g = (inputs.get(n) for n in ("q", "k", "v", "g"))
    launch = kernel_launch(op, inputs)[1]
    o, lse = clean[0], module.forward(q, k, v, g, None, scale, None, launch)[1]
    if op.spec.mask == "sliding_window":
        key, query, rows, keys = 0, T - 1, slice(128, T), slice(0, 128)
    else:
        key, query, rows, keys = T - 1, 0, slice(0, 128), slice(128, T)
    k_bad, v_bad, q_bad, do_bad = k.clone(), v.clone(), q.clone(), do.clone()
    k_bad[:, key] = v_bad[:, key] = q_bad[:, query] = do_bad[:, query] = float("nan")
    # dq with NaN keys and values; dk, dv with NaN queries and output gradients (same o, lse)
    dq_bad = module.softmax_bwd(q, k_bad, v_bad, g, None, scale, None, launch, o, lse, do)[0]
    _, dk_bad, dv_bad, _, _ = module.softmax_bwd(q_bad, k, v, g, None, scale, None, launch, o, lse, do_bad)
    assert torch.equal(dq_bad[:, rows], dq[:, rows])
    assert torch.equal(dk_bad[:, keys], dk[:, keys]) and torch.equal(dv_bad[:, keys], dv[:, keys])
    # the poison is there for the blocks that do see it
    assert torch.isnan(dq_bad).any() and torch.isnan(dk_bad).any()



@pytest.mark.parametrize("return_lse", [False, True], ids=["o", "o_lse"])
def test_torch_compile_fullgraph(return_lse, monkeypatch):
    """A module calling the op compiles with no graph break, forward and backward: the backward
    is an op of its own, so AOTAutograd traces it with fake tensors without launching kernels.
    With return_lse, a loss on the lse too."""
    op = attngen.load(SPECS["forgetting"])
    _, calls = kernel_module(op, monkeypatch)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16, dtype=torch.float64)

        def forward(self, q, k, v, g):
            if not return_lse:
                return op(self.proj(q), k, v, g).square().mean()
            o, lse = op(self.proj(q), k, v, g, return_lse=True)
            return o.square().mean() + lse.square().mean()

    layer = Layer()
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=20, heads=2, head_dim=16, value_dim=8))
    args = [inputs[n] for n in ("q", "k", "v", "g")]
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    compiled(*args).backward()
    grad_c = layer.proj.weight.grad.clone()
    layer.proj.weight.grad = None
    layer(*args).backward()
    assert len(calls) == 2
    assert torch.allclose(grad_c, layer.proj.weight.grad, rtol=1e-12, atol=0)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["causal", "bidirectional", "window16", "forgetting"]),
       kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 3]), Tq=st.integers(1, 40),
       extra=st.integers(0, 30), varlen=st.booleans(), dname=st.sampled_from(list(DTYPES)))
# packed sequences of one token each: every gradient but dv exactly zero
@example(name="forgetting", kv_heads=1, group=2, Tq=1, extra=1, varlen=True, dname="fp32")
def test_grouped_query_heads(name, kv_heads, group, Tq, extra, varlen, dname, monkeypatch):
    """Grouped-query attention: H = group x H_kv query heads over H_kv key / value heads (MQA at
    H_kv = 1), forward and every gradient (dk, dv summed over each group) against the oracle,
    which repeats each key / value head for its group; Tq <= Tk, or packed sequences."""
    if varlen:
        cut = max(1, Tq // 3)
        shape = Shape(batch=1, q_len=Tq + extra, heads=kv_heads * group, kv_heads=kv_heads, head_dim=16,
                      value_dim=8, cu_seqlens=(0, cut, Tq + extra) if cut < Tq + extra else (0, Tq + extra))
    else:
        shape = Shape(batch=2, q_len=Tq, k_len=Tq + extra, heads=kv_heads * group, kv_heads=kv_heads,
                      head_dim=16, value_dim=8)
    check(name, shape, DTYPES[dname], monkeypatch, seed=Tq + extra)


# one query and three in both dtypes; sixteen (the costliest on the interpreter) in bf16
@pytest.mark.parametrize("Tq, Tk, kv_heads, dname", [(1, 300, 2, "fp32"), (1, 300, 2, "bf16"), (3, 531, 1, "fp32"),
                                                     (3, 531, 1, "bf16"), (16, 700, 2, "bf16")])
@pytest.mark.parametrize("name", ["causal", "bidirectional", "window16", "forgetting"])
def test_split_kv_decode(name, Tq, Tk, kv_heads, dname, monkeypatch):
    """Decode (few queries against many keys): the forward splits the keys (flash-decoding) and
    merges the partials by their lse; outputs, the lse the backward reads and every gradient
    against the oracle, and the split forward against the same call unsplit."""
    op = attngen.load(SPECS[name])
    module = codegen.load_module(op.spec)
    splits = spy_kv_splits(module, monkeypatch)
    shape = Shape(batch=2, q_len=Tq, k_len=Tk, heads=2 * kv_heads, kv_heads=kv_heads, head_dim=16, value_dim=8)
    split = {}  # the split call's outputs and gradients, as check ran it
    check(name, shape, DTYPES[dname], monkeypatch, seed=Tk, outputs=split)
    assert splits and max(splits) > 1, f"the keys were not split: {splits}"
    inputs = random_inputs(op.spec, shape, seed=Tk)
    inputs = {n: (t.to(DTYPES[dname]) if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    monkeypatch.setattr(module, "softmax_kv_split_len", lambda Tk, splits, BN: (1, Tk))
    whole = outputs_and_grads(lambda **kw: op(**kw), op.spec, inputs, with_grads=True)
    for n in whole:
        assert rel_error(split[n], whole[n]) <= LOWP_FLOOR[DTYPES[dname]], n

