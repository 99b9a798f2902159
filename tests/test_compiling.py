"""attngen/compiling.py on the CPU: the pool's size from ATTNGEN_COMPILE_THREADS, and which calls
take the dry run (the first of each kind, where the pool has more than one thread, on CUDA and
not under the interpreter). The compilation itself is a GPU test (tests/gpu/test_gpu_compile.py)."""
import inspect

import pytest
import torch

from attngen import compiling


@pytest.fixture(autouse=True)
def fresh_kinds(monkeypatch):
    monkeypatch.setattr(compiling, "_SEEN", set())


@pytest.mark.parametrize("value,expected", [("1", 1), ("6", 6)])
def test_threads_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv("ATTNGEN_COMPILE_THREADS", value)
    assert compiling.threads() == expected


def test_threads_default(monkeypatch):
    monkeypatch.delenv("ATTNGEN_COMPILE_THREADS", raising=False)
    assert 1 <= compiling.threads() <= 16


@pytest.mark.parametrize("value", ["0", "-2", "four", ""])
def test_bad_threads_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("ATTNGEN_COMPILE_THREADS", value)
    with pytest.raises(ValueError, match=r"ATTNGEN_COMPILE_THREADS: value .* allowed: a positive integer"):
        compiling.threads()


def test_first_call_of_each_kind_only(monkeypatch):
    monkeypatch.setenv("ATTNGEN_COMPILE_THREADS", "2")
    ran, modes = [], []
    monkeypatch.setattr(compiling, "compile_only", lambda workers: _Recorder(modes, workers))
    for kind in ("a", "b", "a", "b", "c"):
        compiling.first_call(kind, lambda kind=kind: ran.append(kind))
    assert ran == ["a", "b", "c"] and modes == [2, 2, 2]


def test_one_thread_runs_no_dry_run(monkeypatch):
    monkeypatch.setenv("ATTNGEN_COMPILE_THREADS", "1")
    ran = []
    compiling.first_call("a", lambda: ran.append("a"))
    assert ran == []


def test_applies_on_cuda_only(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not compiling.applies(torch.device("cpu"))
    assert compiling.applies(torch.device("cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not compiling.applies(torch.device("cuda"))


def test_a_failed_compilation_leaves_no_mode_active():
    """A kernel whose compilation raises inside compile_only: the error reaches the caller, and the
    thread's next compile_only (its next first call) starts; Triton's AsyncCompileMode leaves itself
    active when a compilation raised, and every later call failed with "Another AsyncCompileMode is
    already active"."""
    from triton.runtime._async_compile import active_mode

    def broken():
        raise RuntimeError("compilation failed")

    with pytest.raises(RuntimeError, match="compilation failed"):
        with compiling.compile_only(2):
            mode = active_mode.get()
            # the callbacks after key and compile_fn: finalize (Triton 3.6), and cleanup (3.9)
            callbacks = len(inspect.signature(mode.submit).parameters) - 2
            mode.submit("kernel", broken, *[lambda *args: None] * callbacks)
    assert active_mode.get() is None
    with compiling.compile_only(2):
        assert active_mode.get() is not None
    assert active_mode.get() is None


class _Recorder:
    def __init__(self, modes, workers):
        modes.append(workers)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_kind_leaves_out_batch_tokens_and_sequences():
    from attngen.runtime import _compile_kind

    def kinds(B, T, H, K, N):
        tensors = dict(q=torch.empty(B, T, H, K), g=torch.empty(B, T, H), initial_state=torch.empty(N, H, K, K),
                       cu_seqlens=torch.empty(N + 1, dtype=torch.int32), omega=torch.empty(2 * K, K))
        return [_compile_kind(n, t) for n, t in tensors.items()] + [_compile_kind("beta", None)]

    assert kinds(2, 100, 4, 64, 2) == kinds(8, 4096, 4, 64, 8)
    assert kinds(2, 100, 4, 64, 2) != kinds(2, 100, 8, 64, 2)
    assert kinds(2, 100, 4, 64, 2) != kinds(2, 100, 4, 128, 2)
