import functools
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


def _patch_lang_once_per_launch():
    """Triton's interpreter patches triton.language into its interpreted builtins at each kernel
    launch (GridExecutor.__call__, restoring them after it) and again at every call of a
    @triton.jit helper inside the launch (InterpretedFunction.__call__: `_patch_lang`, an
    `inspect.getmembers` walk of the language's modules, whose patches are never restored), though
    the launch, or a helper before, has patched those modules already. The walks were about half of
    the kernel tests' time: the helpers run in every loop of the generated kernels. A helper called
    inside a launch whose modules are patched so far in that launch now skips the walk; launches,
    and a helper naming a module not yet patched in its launch, patch as before."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton import language as tl
    from triton.runtime import interpreter

    patch, scope_type = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch is None or scope_type is None or executor is None:
        return
    run = executor.__call__
    running = []  # (kernel, the language modules patched so far) of the launch in progress

    @functools.cache
    def langs(fn):
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    def patch_once(fn):
        if not running or fn is running[-1][0]:
            return patch(fn)
        patched, wanted = running[-1][1], langs(fn)
        if wanted <= patched:
            return scope_type()
        scope = patch(fn)  # as the helper's patches are never restored, they hold to the launch's end
        patched.update(wanted)
        return scope

    def launch(self, *args, **kwargs):
        running.append((self.fn, set(langs(self.fn))))
        try:
            return run(self, *args, **kwargs)
        finally:
            running.pop()

    interpreter._patch_lang = patch_once
    executor.__call__ = launch


_patch_lang_once_per_launch()


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
