"""Gradients on the GPU (compiled mode): every shipped spec x bf16/fp32 x T x head dim,
gradients of q, k, v, g, beta and the initial state (a loss on the output and on the final
state) against float64 autograd through the interpreter (on the CPU), with tolerances relative to the
interpreter run in the same low precision (attngen.testing.compare).

Run on a CUDA machine: bash gpu.sh tests/gpu/<this file>
"""
import pytest
import torch

import attngen
from attngen import codegen
from attngen.testing import Shape, compare, force_launch, random_inputs, spy_launches

from specs import SHIPPED, shipped

SPECS = shipped()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _cases():
    for path in SPECS:
        for dname in DTYPES:
            # K = V = 256 in bf16 (the planner's launches past 128 feature lanes) at one length
            for T, d in [(T, d) for T in (63, 1000, 8192) for d in (64, 100, 128)] + [(1000, 256)] * (dname == "bf16"):
                yield pytest.param(path, dname, T, d, id=f"{path.stem}-{dname}-T{T}-D{d}",
                                   marks=pytest.mark.xdist_group(f"{path.stem}-{dname}"))


@pytest.mark.parametrize("path,dname,T,d", list(_cases()))
def test_gradients_match_oracle(path, dname, T, d):
    op = attngen.load(path)
    shape = Shape(batch=1, q_len=T, heads=2, head_dim=d, value_dim=d)
    # the oracles' token loops run on the CPU, but at T = 8192 (8192 steps of autograd) on the GPU
    where = "cuda" if T > 1000 else "cpu"
    inputs = {n: t.to(where) for n, t in random_inputs(op.spec, shape, seed=T * 7 + d).items()}
    rows = compare(op.spec, lambda **kw: op(**kw), inputs, DTYPES[dname], with_grads=True, device="cuda")
    bad = [f"{n}: {e:.2e} > {t:.2e}" for n, e, t in rows if not e <= t]
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("dname", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet", "kda"])
def test_gradients_from_the_forwards_segment_starts(name, dname, monkeypatch):
    """The delta rules' state passes by four segments of 256 tokens (1000 tokens; forward chunks of 64, backward
    chunks of 32): the backward's recomputation starts from the states entering the segments that the forward's
    walk left (the op's `starts`), with no segment ends of its own; gradients against the oracle."""
    op = attngen.load(SHIPPED[name])
    force_launch(monkeypatch, chunk=64, bwd_chunk=32, segments=4)
    launches = spy_launches(monkeypatch, codegen.load_module(op.spec), ["chunked_states_kernel"])
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=1000, heads=2, head_dim=128, value_dim=128), seed=5)
    rows = compare(op.spec, lambda **kw: op(**kw, form="chunked"), inputs, DTYPES[dname], with_grads=True,
                   device="cuda")
    bad = [f"{n}: {e:.2e} > {t:.2e}" for n, e, t in rows if not e <= t]
    assert not bad, "; ".join(bad)
    # the forward's ends and states, then the backward's states alone
    assert [kw["ENDS"] for _, _, kw in launches] == [True, False, False], [(g, kw["ENDS"]) for _, g, kw in launches]


@pytest.mark.parametrize("T", [63, 1000])
@pytest.mark.parametrize("d", [100, 128])
def test_bidirectional_float32_favor_kernels(d, T, monkeypatch):
    """The bidirectional backward's kernels for float32 FAVOR+ past 64 key lanes (float64 projections in the state
    step, as in the forward; float32 ones in the rows steps) run and match the oracle."""
    op = attngen.load(SHIPPED["performer_bidirectional"])
    module = codegen.load_module(op.spec)
    real, calls = module.bidirectional_bwd, []

    def counted(*args):
        calls.append(True)
        return real(*args)

    monkeypatch.setattr(module, "bidirectional_bwd", counted)
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=T, heads=2, head_dim=d, value_dim=d), seed=T * 7 + d)
    rows = compare(op.spec, lambda **kw: op(**kw), inputs, torch.float32, with_grads=True, device="cuda")
    assert calls, "the kernels' backward did not run"
    bad = [f"{n}: {e:.2e} > {t:.2e}" for n, e, t in rows if not e <= t]
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("name", ["retnet", "mamba2", "gla", "gated_deltanet"])
def test_decay_gradient_not_asked_for(name):
    """A log decay without requires_grad: g.grad stays None and the other gradients are those of a call
    that asks for dg too (the additive rule's dq and dk steps compiled without the decay gradient's terms)."""
    op = attngen.load(SHIPPED[name])
    inputs = random_inputs(op.spec, Shape(batch=2, q_len=1000, heads=2, head_dim=128, value_dim=128), seed=11)
    inputs = {n: (t.to("cuda", torch.bfloat16) if n in ("q", "k", "v", "beta") else t.to("cuda")) for n, t in inputs.items()}
    do = torch.randn(inputs["v"].shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).to(torch.bfloat16)
    grads = {}
    for asked in (True, False):
        leaves = {n: t.detach().clone().requires_grad_(n != "g" or asked) for n, t in inputs.items()}
        o, _ = op(**leaves)
        o.backward(do)
        grads[asked] = {n: t.grad for n, t in leaves.items()}
    assert grads[True]["g"] is not None and grads[False]["g"] is None
    for n, t in grads[True].items():
        if n != "g":
            err = (grads[False][n].float() - t.float()).norm() / t.float().norm()
            assert err <= 1e-6, f"{n}: {err:.2e}"
