"""examples/hybrid_lm.py stays runnable: a few training steps of the hybrid model, then
generation through its layers' StateCaches reproduces the full forward (on the PyTorch forms,
and served by the kernels through Triton's interpreter)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import hybrid_lm  # noqa: E402


@pytest.fixture(autouse=True)
def small_task(monkeypatch):
    """The example's task at a third of its size: the tests check that it runs and serves, not
    what it learns."""
    monkeypatch.setattr(hybrid_lm, "PAIRS", 8)
    monkeypatch.setattr(hybrid_lm, "QUERIES", 8)


def test_hybrid_lm_runs(monkeypatch):
    monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
    results = hybrid_lm.main(["--steps", "1", "--models", "hybrid", "--eval", "8"])
    recall, agree, max_diff = results["hybrid"]
    assert agree == 1.0 and max_diff < 1e-4


def test_hybrid_lm_served_by_the_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
    model = hybrid_lm.train(hybrid_lm.MODELS["hybrid"], 1, "cpu")
    tokens, _ = hybrid_lm.recall_batch(torch.Generator().manual_seed(0), 3)
    with torch.no_grad():
        full = model(tokens)
    monkeypatch.setenv("ATTNGEN_BACKEND", "triton")
    monkeypatch.setenv("ATTNGEN_CACHE", str(tmp_path))
    served = hybrid_lm.serve(model, tokens, piece=5)
    assert (served - full).abs().max() < 1e-4


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("triton", torch.float32)])
def test_depth_mix_is_attention_residuals(monkeypatch, tmp_path, backend, dtype):
    """The example's DepthMix (a softmax spec over the depth axis) is Attention Residuals: o = sum_l
    p_l v_l with p = softmax_l(q . RMSNorm(v_l) / sqrt(D)), here written out in float64; outputs and
    the gradients of the blocks' outputs, the query and the norm's weight. (bench/attnres.py checks
    it against flash-linear-attention's attnres on the same inputs.)"""
    monkeypatch.setenv("ATTNGEN_BACKEND", backend)
    monkeypatch.setenv("ATTNGEN_CACHE", str(tmp_path))
    N, L, D = 6, 5, 16
    torch.manual_seed(0)
    mix = hybrid_lm.DepthMix(D).to(dtype)
    with torch.no_grad():
        mix.query.normal_()
        mix.norm.weight.uniform_(0.5, 1.5)
    stack = torch.randn(N, 1, L, D, dtype=dtype, requires_grad=True)
    do = torch.randn(N, 1, D, dtype=dtype)
    leaves = (stack, mix.query, mix.norm.weight)
    got = [mix(stack)]
    got += torch.autograd.grad(got[0], leaves, do)

    x, q, w = (t.detach().double().requires_grad_(True) for t in leaves)
    eps = torch.finfo(dtype).eps
    keys = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    p = torch.softmax((keys * q).sum(-1) / D ** 0.5, dim=-1)      # [N, 1, L]
    want = [(p[..., None] * x).sum(-2)]
    want += torch.autograd.grad(want[0], (x, q, w), do.double())
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for name, a, b in zip(("o", "d blocks", "d query", "d weight"), got, want):
        err = float((a.double() - b).norm() / b.norm())
        assert err < tol, (name, err)
