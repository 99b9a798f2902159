"""return_lse on the softmax ops (issue 12): attention over parts of the keys, merged by each
part's log-sum-exp, equals attention over all of them, outputs and gradients, on the kernels
(Triton's interpreter) and on the PyTorch forms; the op contract (torch.ops.attngen.<name>) and
the rejections. The lse itself and its gradient against the oracle: test_kernels_softmax_bwd.py
and test_forms.py."""
from __future__ import annotations

import pytest
import torch

import attngen
from attngen import codegen
from attngen.reference import reference
from attngen.testing import FLOAT64_RTOL, Shape, random_inputs, rel_error

from specs import SHIPPED



def merge(o1, lse1, o2, lse2):
    """Two attentions of the same queries over disjoint keys -> the attention over their union:
    each output weighted by its share exp(lse_part - lse) of the softmax's normalizer."""
    lse = torch.logaddexp(lse1, lse2)
    return (o1 * torch.exp(lse1 - lse)[..., None] + o2 * torch.exp(lse2 - lse)[..., None]), lse


def results(fn, leaves: dict) -> list[torch.Tensor]:
    """(o, lse) of fn(**leaves) and the gradients of a random loss on both wrt q, k, v."""
    o, lse = fn(**leaves)
    gen = torch.Generator().manual_seed(5)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() \
        + (lse * torch.randn(lse.shape, generator=gen, dtype=lse.dtype)).sum()
    return [o, lse, *torch.autograd.grad(loss, [leaves[n] for n in ("q", "k", "v")])]


def leaves_of(inputs: dict) -> dict:
    return {n: t.detach().clone().requires_grad_(n in ("q", "k", "v")) for n, t in inputs.items()}


def check_merge(whole, halves, inputs: dict) -> None:
    merged = results(lambda **kw: merge(*halves(**kw)), leaves_of(inputs))
    full = results(whole, leaves_of(inputs))
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), merged, full):
        assert rel_error(a, b) <= FLOAT64_RTOL, f"{name}: merged halves differ from the whole call"


@pytest.mark.parametrize("Tq, Tk, kv_heads", [(1, 300, 2), (3, 70, 1), (5, 21, 4)])
@pytest.mark.parametrize("name", ["softmax_causal", "softmax_bidirectional"])
def test_merging_halves_of_the_keys(name, Tq, Tk, kv_heads, backend):
    """Decode against a cache split in two (Tq = 1 splits the keys inside the kernel too; grouped
    heads at H_kv < H): queries see every key of both halves, the first half unmasked; the last
    Tq keys' causal mask stays in the second half's call. float64, where the identity is exact
    to rounding."""
    op = attngen.load(SHIPPED[name])
    inputs = random_inputs(op.spec, Shape(batch=2, q_len=Tq, k_len=Tk, heads=4, kv_heads=kv_heads, head_dim=16,
                                          value_dim=8), seed=Tk)
    cut = Tk // 2
    every = attngen.load("specs/softmax_bidirectional.yaml")

    def halves(q, k, v):
        return (*every(q, k[:, :cut], v[:, :cut], return_lse=True), *op(q, k[:, cut:], v[:, cut:], return_lse=True))

    check_merge(lambda **kw: op(**kw, return_lse=True), halves, inputs)


def test_merging_a_prefix_with_causal_attention(backend):
    """Chunked prefill: a chunk's queries attend to a cached prefix in full (bidirectional) and to
    the chunk's own keys causally; merged, that is causal attention over the whole sequence."""
    causal = attngen.load("specs/softmax_causal.yaml")
    every = attngen.load("specs/softmax_bidirectional.yaml")
    T, prefix = 90, 57
    inputs = random_inputs(causal.spec, Shape(batch=1, q_len=T, heads=2, head_dim=16, value_dim=8), seed=3)
    inputs["q"] = inputs["q"][:, prefix:]

    def halves(q, k, v):
        return (*every(q, k[:, :prefix], v[:, :prefix], return_lse=True),
                *causal(q, k[:, prefix:], v[:, prefix:], return_lse=True))

    check_merge(lambda **kw: causal(**kw, return_lse=True), halves, inputs)


@pytest.mark.parametrize("name", ["softmax_causal", "forgetting_attention"])
def test_lse_of_packed_sequences(name, backend):
    """With cu_seqlens, lse is [1, T, H]: each packed token's row equals the same sequence's
    call alone."""
    op = attngen.load(SHIPPED[name])
    cu = (0, 1, 66, 83, 100)
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=100, heads=2, head_dim=16, value_dim=8, cu_seqlens=cu))
    _, lse = op(**inputs, return_lse=True)
    assert lse.shape == (1, 100, 2) and lse.dtype == torch.float64
    for s, e in zip(cu, cu[1:]):
        alone = {n: t[:, s:e] for n, t in inputs.items() if n != "cu_seqlens"}
        assert rel_error(lse[:, s:e], op(**alone, return_lse=True)[1]) <= FLOAT64_RTOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_lse_dtype_and_layout(dtype, backend):
    """lse is [B, Tq, H], float32 (float64 for float64 inputs), and the output is unchanged by asking."""
    op = attngen.load("specs/sliding_window.yaml")
    inputs = random_inputs(op.spec, Shape(batch=2, q_len=5, k_len=9, heads=3, head_dim=8, value_dim=4))
    inputs = {n: t.to(dtype) for n, t in inputs.items()}
    o, lse = op(**inputs, return_lse=True)
    assert lse.shape == (2, 5, 3)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(o, op(**inputs))
    want = reference(op.spec, **inputs, return_lse=True)[1]
    assert rel_error(lse, want) < (1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.usefixtures("triton_backend")
def test_op_contract_return_lse():
    """torch.ops.attngen.<name>: a Tensor without return_lse; with it, its overload .lse returns
    (o, lse) as attngen.load's op does (lse empty for return_lse=False)."""
    op = attngen.load("specs/forgetting_attention.yaml")
    codegen.load_module(op.spec)
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=6, k_len=11, heads=2, head_dim=8, value_dim=4),
                           dtype=torch.float32)
    contract = torch.ops.attngen.forgetting_attention
    o, lse = op(**inputs, return_lse=True)
    assert torch.equal(contract(**inputs), o)
    got = contract(**inputs, return_lse=True)
    assert torch.equal(got[0], o) and torch.equal(got[1], lse)
    o_only, empty = contract(**inputs, return_lse=False)
    assert torch.equal(o_only, o) and empty.numel() == 0


def test_return_lse_rejected_where_it_means_nothing():
    linear = attngen.load("specs/gla.yaml")
    inputs = random_inputs(linear.spec, Shape(batch=1, q_len=4, heads=1, head_dim=4, value_dim=4))
    with pytest.raises(ValueError, match="return_lse: spec 'gla' is linear attention"):
        linear(**inputs, return_lse=True)
    with pytest.raises(ValueError, match="return_lse: linear attention has no log-sum-exp"):
        reference(linear.spec, **inputs, return_lse=True)
    softmax = attngen.load("specs/softmax_causal.yaml")
    inputs = random_inputs(softmax.spec, Shape(batch=1, q_len=4, heads=1, head_dim=4, value_dim=4))
    with pytest.raises(ValueError, match="return_lse: expected True or False, got 1"):
        softmax(**inputs, return_lse=1)
