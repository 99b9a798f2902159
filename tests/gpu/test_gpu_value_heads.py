"""Grouped value heads on the GPU (compiled mode): causal linear specs with H = 4 query / key heads
and HV = 8 or 16 value heads, the recurrent and chunked kernels, outputs and gradients against the
float64 oracle (attngen.testing.compare; on the GPU for the chunked cases); and a decode step of H query / key heads on a
StateCache of HV heads, token by token, against one forward.

Run on a CUDA machine: bash gpu.sh tests/gpu/<this file>
"""
import pytest
import torch

import attngen
from attngen.reference import reference
from attngen.testing import Shape, compare, random_inputs, rel_error, tolerance

from specs import SHIPPED

SPECS = ("gated_deltanet", "kda", "mamba2", "gla", "linear_transformer", "retnet")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _cases():
    for name in SPECS:
        for dname in DTYPES:
            for group, T in ((2, 12), (4, 1000)):
                yield pytest.param(name, dname, group, T, id=f"{name}-{dname}-G{group}-T{T}",
                                   marks=pytest.mark.xdist_group(f"{name}-{dname}"))


@pytest.mark.parametrize("name,dname,group,T", list(_cases()))
def test_grouped_value_heads(name, dname, group, T):
    """T = 12 runs the recurrent kernel, T = 1000 the chunked one."""
    op = attngen.load(SHIPPED[name])
    shape = Shape(batch=2, q_len=T, heads=4, value_heads=4 * group, head_dim=128, value_dim=128)
    # the oracles' token loops on the GPU at T = 1000 (as test_gpu_backward's past 1000 tokens): on the
    # CPU, 1000 steps of float64 autograd over 16 heads took 190-235 s a case, most of the file's time
    where = "cuda" if T >= 1000 else "cpu"
    inputs = {n: t.to(where) for n, t in random_inputs(op.spec, shape, seed=T + group).items()}
    rows = compare(op.spec, lambda **kw: op(**kw), inputs, DTYPES[dname], with_grads=True, device="cuda")
    bad = [f"{n}: {e:.2e} > {t:.2e}" for n, e, t in rows if not e <= t]
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("name", SPECS)
def test_decode_with_grouped_value_heads(name):
    """A prefill of 50 tokens, then 8 decode steps of the prepared step, equal one forward."""
    op = attngen.load(SHIPPED[name])
    H, HV, D, T, prefill = 4, 16, 128, 58, 50
    x = random_inputs(op.spec, Shape(batch=3, q_len=T, heads=H, value_heads=HV, head_dim=D, value_dim=D), seed=3,
                      dtype=torch.float32, initial_state=False)
    cuda = {n: t.cuda() for n, t in x.items()}
    per_token = lambda n, t: n != "g" or t.dim() > 1
    piece = lambda a, b: {n: (t[:, a:b].contiguous() if per_token(n, t) else t) for n, t in cuda.items()}
    cache = attngen.StateCache(op, slots=5, heads=HV, head_dim=D, value_dim=D, device="cuda")
    slots = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        outs = [op(**piece(0, prefill), cache=cache, slots=slots)[0]]
        step = op.prepare_decode(cache, batch=3, heads=H)
        for t in range(prefill, T):
            outs.append(step(**piece(t, t + 1), slots=slots).clone())
    ref_o, ref_s = reference(op.spec, **x, output_final_state=True)
    low_o, low_s = reference(op.spec, **x, output_final_state=True, dtype=torch.float32)
    for what, got, ref, low in (("o", torch.cat(outs, 1), ref_o, low_o), ("state", cache.state[slots.long()], ref_s,
                                                                           low_s)):
        err, tol = rel_error(got.cpu(), ref), tolerance(torch.float32, rel_error(low, ref))
        assert err <= tol, f"{what}: rel err {err:.2e} > tol {tol:.2e}"
