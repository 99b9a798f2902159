import os

import pytest
import torch

if torch.cuda.is_available():
    # tests/gpu run the compiled kernels (see gpu.sh)
    collect_ignore = []
else:
    collect_ignore = ["gpu"]
    # Kernel tests run the generated kernels through Triton's interpreter; it must be chosen
    # before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def triton_backend(monkeypatch, tmp_path_factory):
    """Force the generated kernels for one test (other tests keep the default backend)."""
    monkeypatch.setenv("ATTNGEN_BACKEND", "triton")
    monkeypatch.setenv("ATTNGEN_CACHE", str(tmp_path_factory.getbasetemp() / "attngen_cache"))


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    """Each test once on the generated kernels (Triton's interpreter) and once on the PyTorch forms."""
    if request.param == "triton":
        request.getfixturevalue("triton_backend")
    else:
        monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
    return request.param


@pytest.fixture
def poison_fresh_buffers(monkeypatch):
    """torch.empty, torch.empty_like and Tensor.new_empty return NaN-filled floating tensors (as
    uninitialized memory may hold): a kernel that leaves an element it returns or reads unwritten
    fails its test."""
    def poisoned(alloc):
        def wrapper(*args, **kwargs):
            out = alloc(*args, **kwargs)
            return out.fill_(float("nan")) if out.is_floating_point() else out
        return wrapper

    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned(torch.Tensor.new_empty))
