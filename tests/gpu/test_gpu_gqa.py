"""Grouped-query softmax attention on the GPU (compiled mode): every shipped softmax spec with
H = 8 query heads over H_kv = 2 (and MQA, H_kv = 1) key / value heads, outputs and gradients
against the float64 oracle on the CPU (attngen.testing.compare), Tq = Tk and Tq < Tk; with lse,
return_lse's log-sum-exp too and the gradients of a loss on o and on it, in a full call and a
decode step whose keys the forward splits (flash-decoding: the last split program of a query block
merges the partials by their lse).

Run on a CUDA machine: bash gpu.sh tests/gpu/<this file>
"""
import pytest
import torch

import attngen
from attngen.testing import Shape, compare, random_inputs

from specs import shipped

SPECS = shipped("softmax")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (H_kv, Tq, Tk, lse): the full call with and without the log-sum-exp (a loss on it reaches the
# backward kernels as dlse; without, they take none), MQA with Tq < Tk, and MQA decode
CASES = ((2, 1000, 1000, False), (2, 1000, 1000, True), (1, 300, 1000, False), (1, 1, 8192, True))


def _cases():
    for path in SPECS:
        for dname in DTYPES:
            for kv_heads, Tq, Tk, lse in CASES:
                yield pytest.param(path, dname, kv_heads, Tq, Tk, lse,
                                   id=f"{path.stem}-{dname}-Hkv{kv_heads}-Tq{Tq}-Tk{Tk}{'-lse' if lse else ''}",
                                   marks=pytest.mark.xdist_group(f"{path.stem}-{dname}"))


@pytest.mark.parametrize("path,dname,kv_heads,Tq,Tk,lse", list(_cases()))
def test_grouped_query_heads(path, dname, kv_heads, Tq, Tk, lse):
    op = attngen.load(path)
    shape = Shape(batch=1, q_len=Tq, k_len=Tk, heads=8, kv_heads=kv_heads, head_dim=128, value_dim=128)
    inputs = random_inputs(op.spec, shape, seed=Tq + kv_heads)
    rows = compare(op.spec, lambda **kw: op(**kw), inputs, DTYPES[dname], with_grads=True, device="cuda", lse=lse)
    assert ("lse" in {n for n, _, _ in rows}) == lse
    bad = [f"{n}: {e:.2e} > {t:.2e}" for n, e, t in rows if not e <= t]
    assert not bad, "; ".join(bad)
