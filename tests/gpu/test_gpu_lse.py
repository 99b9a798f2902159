"""return_lse on the GPU (compiled mode): every shipped softmax spec's log-sum-exp and the
gradients of a loss on o and on it against the float64 oracle on the CPU
(attngen.testing.compare), a full call and a decode step whose keys the forward splits
(flash-decoding: the combine kernel merges the partial lse).

Run on a CUDA machine: bash gpu.sh tests/gpu/<this file>
"""
import pytest
import torch

import attngen
from attngen.testing import Shape, compare, random_inputs

from specs import shipped

SPECS = shipped("softmax")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _cases():
    for path in SPECS:
        for dname in DTYPES:
            for kv_heads, Tq, Tk in ((2, 1000, 1000), (1, 1, 8192)):
                yield pytest.param(path, dname, kv_heads, Tq, Tk, id=f"{path.stem}-{dname}-Hkv{kv_heads}-Tq{Tq}-Tk{Tk}",
                                   marks=pytest.mark.xdist_group(f"{path.stem}-{dname}"))


@pytest.mark.parametrize("path,dname,kv_heads,Tq,Tk", list(_cases()))
def test_lse_and_its_gradient(path, dname, kv_heads, Tq, Tk):
    op = attngen.load(path)
    shape = Shape(batch=1, q_len=Tq, k_len=Tk, heads=8, kv_heads=kv_heads, head_dim=128, value_dim=128)
    inputs = random_inputs(op.spec, shape, seed=Tq + kv_heads)
    rows = compare(op.spec, lambda **kw: op(**kw), inputs, DTYPES[dname], with_grads=True, device="cuda", lse=True)
    assert "lse" in {n for n, _, _ in rows}
    bad = [f"{n}: {e:.2e} > {t:.2e}" for n, e, t in rows if not e <= t]
    assert not bad, "; ".join(bad)
