"""Training smoke test: a 2-layer model with a generated op (PyTorch forms on the CPU)
learns to recall the token seen three steps earlier."""
from training import train


def test_mamba2_layers_learn_recall(monkeypatch):
    monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
    losses = train("specs/mamba2.yaml", steps=200, lr=1e-2)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.6 * first, f"loss went from {first:.3f} to {last:.3f}"


def test_training_is_deterministic(monkeypatch):
    monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
    assert train("specs/linear_transformer.yaml", steps=5) == train("specs/linear_transformer.yaml", steps=5)
