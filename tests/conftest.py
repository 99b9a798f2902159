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
