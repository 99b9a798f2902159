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
