"""Training on the GPU through the kernels follows the CPU run through the PyTorch forms:
same data, same initial weights, loss curves agree step by step while both learn."""
import pytest

from training import train


@pytest.mark.parametrize("spec", ["specs/mamba2.yaml", "specs/gated_deltanet.yaml", "specs/softmax_causal.yaml"])
def test_gpu_loss_curve_matches_cpu(spec, monkeypatch):
    gpu = train(spec, steps=200, lr=1e-2, device="cuda")
    monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
    cpu = train(spec, steps=200, lr=1e-2, device="cpu")
    early = max(abs(a - b) for a, b in zip(gpu[:30], cpu[:30]))
    assert early < 2e-2, f"loss curves part within 30 steps: max gap {early:.3e}"
    assert sum(gpu[-10:]) < 0.8 * sum(gpu[:10])
