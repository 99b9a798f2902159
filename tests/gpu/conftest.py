import gc
import os
import sys
from pathlib import Path

import pytest
import torch

# the helpers of the CPU tests (training.py, strategies.py) live in tests/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The oracles run on the CPU: share its cores among the test processes
torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Give each test's cached GPU blocks back: several test processes share one GPU."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def pytest_runtest_logreport(report):
    """Each failure goes to $GPU_FAILURES (when set) as it happens, so a run cut short by its
    time limit still says which tests failed and why."""
    path = os.environ.get("GPU_FAILURES")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        lines = str(report.longrepr).splitlines()
        why = [ln for ln in lines if ln.startswith("E ") and "CUDA_DSA" not in ln][-6:] or lines[-6:]
        with open(path, "a") as f:
            f.write(f"{report.nodeid} [{report.when}, {report.duration:.1f}s]\n  " + "\n  ".join(why) + "\n")
