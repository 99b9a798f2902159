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


@pytest.fixture
def warm_threads(monkeypatch, tmp_path):
    """warm_key on a machine that looks like a GPU's (a driver file present), Triton's hash replaced by a
    counter; the threads it starts, fresh."""
    calls = []
    monkeypatch.setattr(compiling, "_WARM", {})
    monkeypatch.setattr(compiling, "_triton_key", lambda: calls.append("triton_key"))
    (tmp_path / "nvidiactl").write_text("")
    monkeypatch.setattr(compiling, "_NVIDIA_FILES", (str(tmp_path / "absent"), str(tmp_path / "nvidiactl")))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("ATTNGEN_COMPILE_THREADS", "2")
    return calls


def test_warm_key_starts_triton_key_once(warm_threads):
    compiling.warm_key()
    compiling.warm_key()
    assert list(compiling._WARM) == ["key"]
    compiling._WARM["key"].join()
    assert warm_threads == ["triton_key"]


@pytest.mark.parametrize("case", ["no driver", "interpreter", "one thread", "bad threads"])
def test_warm_key_starts_nothing(warm_threads, monkeypatch, case):
    if case == "no driver":
        monkeypatch.setattr(compiling, "_NVIDIA_FILES", ("/nonexistent/nvidiactl",))
    elif case == "interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.setenv("ATTNGEN_COMPILE_THREADS", "1" if case == "one thread" else "four")
    compiling.warm_key()   # a bad ATTNGEN_COMPILE_THREADS is the op's error to report, not the import's
    assert compiling._WARM == {} and warm_threads == []


def test_first_call_joins_the_warm_threads(warm_threads, monkeypatch):
    import threading
    release, events = threading.Event(), []
    monkeypatch.setattr(compiling, "_triton_key", lambda: (release.wait(5), events.append("triton_key")))
    compiling.warm_key()
    monkeypatch.setattr(compiling, "compile_only", lambda workers: _Recorder(events, workers))
    threading.Timer(0.2, release.set).start()
    compiling.first_call("a", lambda: events.append("dry run"))
    assert events == ["triton_key", 2, "dry run"]


def test_import_after_torch_starts_the_key_where_a_gpu_driver_is():
    import os
    import subprocess
    import sys
    code = "import torch, attngen; from attngen import compiling; print(sorted(compiling._WARM))"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ATTNGEN_COMPILE_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    gpu_driver = any(map(os.path.exists, compiling._NVIDIA_FILES)) and min(os.cpu_count() or 1, 16) > 1
    assert out.strip() == ("['key']" if gpu_driver else "[]")


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


class _FakeModule:
    """A generated module's surface that compiling.dry_run calls, recording how."""
    SAVED_INPUTS = ("q", "k")

    def __init__(self):
        self.calls = []

    def op(self, *args):
        raise AssertionError("the dry run went through the registered op")

    def forward(self, *args):
        self.calls.append(("forward", args))
        return torch.zeros(3), None

    def backward(self, *args, dispatch=True):
        self.calls.append(("backward", len(args), dispatch))


def test_dry_run_calls_the_kernels_without_the_dispatcher():
    """The registered ops' first call imports torch._dynamo (some seconds): the dry run calls the
    generated forward and the backward's kernels directly, so that their compilations start first."""
    module = _FakeModule()
    compiling.dry_run(module, ("q", "k", "scale"), backward=True)
    assert module.calls == [("forward", ("q", "k", "scale")), ("backward", 3 + 2 + 2, False)]
    module = _FakeModule()
    compiling.dry_run(module, ("q", "k", "scale"), backward=False)
    assert [c[0] for c in module.calls] == ["forward"]


def test_first_call_makes_the_ops_import_while_the_pool_compiles(monkeypatch):
    import builtins
    monkeypatch.setenv("ATTNGEN_COMPILE_THREADS", "2")
    events = []

    class Pool:
        def __enter__(self):
            events.append("pool")

        def __exit__(self, *exc):
            events.append("compiled")
            return False

    real_import = builtins.__import__

    def recording_import(name, globals=None, *args, **kwargs):
        # first_call's own import only: torch._dynamo's first import (in a process that has not made it yet)
        # imports "torch._dynamo" again from inside its own modules
        if name == "torch._dynamo" and (globals or {}).get("__name__") == compiling.__name__:
            events.append("import torch._dynamo")
        return real_import(name, globals, *args, **kwargs)

    monkeypatch.setattr(compiling, "compile_only", lambda workers: Pool())
    monkeypatch.setattr(builtins, "__import__", recording_import)
    compiling.first_call("a", lambda: events.append("dry run"))
    monkeypatch.undo()
    assert events == ["pool", "dry run", "import torch._dynamo", "compiled"]


def test_launcher_ahead_only_for_a_compilation_job_it_can_read():
    assert compiling._launcher_ahead(lambda: None) is None

    class Src:
        signature = {"q": "*bf16", "k_desc": "tensordesc<bf16[64, 128]>"}

    src = Src()
    assert compiling._launcher_ahead(lambda: src) is None   # a tensor descriptor: built after the kernel


@pytest.mark.parametrize("name", ["gated_deltanet", "softmax_causal"])
def test_backward_kernels_without_the_dispatcher_match_the_op(triton_backend, name):
    """backward(..., dispatch=False), the dry run's backward, gives the registered op's gradients."""
    from pathlib import Path

    import attngen
    from attngen import codegen
    from attngen.signature import LINEAR_OP, SOFTMAX_OP
    from attngen.testing import Shape, kernel_launch, random_inputs

    op = attngen.load(Path(__file__).resolve().parents[1] / "specs" / f"{name}.yaml")
    module = codegen.load_module(op.spec)
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=40, heads=2, head_dim=16, value_dim=16), seed=3)
    names = ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens") if op.spec.is_linear else ("q", "k", "v", "g", "cu_seqlens")
    values = {n: inputs.get(n) for n in names}
    if op.spec.is_linear:
        form, launch = kernel_launch(op, inputs, "chunked")
        args = LINEAR_OP.bind(**values, omega=None, scale=0.25, form=form, launch=launch, output_final_state=False,
                              for_backward=True)
    else:
        args = SOFTMAX_OP.bind(**values, scale=0.25, max_len=None, launch=kernel_launch(op, inputs)[1])
    outs = module.forward(*args)
    n = len(module.SAVED_INPUTS)
    do = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(4))
    grads = (do, *[None] * (len(outs) - 1))
    via_op = module.backward(*args[:n], *args[n:], *outs, *grads)
    direct = module.backward(*args[:n], *args[n:], *outs, *grads, dispatch=False)
    assert len(via_op) == len(direct) and any(a is not None for a in direct)
    for a, b in zip(via_op, direct):
        assert (a is None and b is None) or torch.equal(a, b)
