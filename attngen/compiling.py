"""A call's kernels compiled side by side before it first runs.

A spec's forward and backward launch some ten Triton kernels, and Triton compiles each when it is
first launched, one after the other (about a second each). The first call of a new kind (shapes,
dtypes, form, launch) therefore runs once with every launch turned into a compilation only,
submitted to a pool of threads (Triton's AsyncCompileMode: its compilation passes and ptxas run
outside the GIL), which also builds each kernel's C launcher; then it runs for real on the
compiled kernels. A later call of that kind skips
the pass; one whose kernels are all compiled costs its host time only.

The first call in a process also pays one-time costs that are not compilation. Where they would
hold back the pool, they are moved beside it: Triton's hash of its own sources and library
(triton_key, which reads libtriton, about a second) and its CUDA driver's utilities (a C module it
builds) run on threads of their own, the first from `import attngen` where torch is already imported
(warm_key), both from the moment an op is made (warm); the dry run calls the
generated kernels without the dispatcher, and the import of torch._dynamo, which torch's custom
ops make on their first call (two seconds on the H200's host), runs while the pool compiles
(gated_deltanet's first call: BENCHMARKS.md).

ATTNGEN_COMPILE_THREADS: threads of the pool (default: the CPU count, at most 16); 1 turns the
pass off (each kernel then compiles when it is first launched, as in plain Triton).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Hashable

import torch

_COMPILE_ONLY = contextvars.ContextVar("attngen_compile_only", default=False)
_SEEN: set = set()
_WARM: dict[str, threading.Thread] = {}


def threads() -> int:
    """The pool's threads (ATTNGEN_COMPILE_THREADS, default the CPU count up to 16)."""
    value = os.environ.get("ATTNGEN_COMPILE_THREADS")
    if value is None:
        return min(os.cpu_count() or 1, 16)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"ATTNGEN_COMPILE_THREADS: value {value!r} is not allowed; allowed: a positive integer "
                         "(1: no parallel compilation)")
    return int(value)


@functools.cache
def _install() -> None:
    """Wrap Triton's JITFunction.run once: inside compile_only() a launch is a warm-up (compiled,
    not run); everywhere else it is unchanged."""
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    @functools.wraps(run)
    def launch_or_compile(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=warmup or _COMPILE_ONLY.get(), **kwargs)

    JITFunction.run = launch_or_compile


class _Pool(ThreadPoolExecutor):
    """The compilation pool: each job also builds its kernel's launcher."""

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(_with_launcher, fn, *args, **kwargs)


def _with_launcher(compile_fn, *args, **kwargs):
    """compile_fn's kernel, its C launcher built: Triton builds a kernel's launcher (a C compiler
    run, up to a second, kept in its cache) when the kernel is first launched, on the launching
    thread; built here, the launch finds it in the cache. The launcher's source depends on the
    kernel's signature alone where the kernel takes no tensor descriptor: it is then built beside
    the compilation (_launcher_ahead) rather than after it."""
    ahead = _launcher_ahead(compile_fn)
    kernel = compile_fn(*args, **kwargs)
    if ahead is not None:
        ahead.join()
    try:
        from triton.runtime import driver
        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 -- not built here, the first launch builds it (and reports any error)
        pass
    return kernel


# What Triton's CUDA launcher reads of a compiled kernel's metadata besides the signature, for a
# launcher built before the kernel is compiled (only its C module is kept: in Triton's cache)
_LAUNCHER_METADATA = dict(tensordesc_meta=None, num_ctas=1, global_scratch_size=0, global_scratch_align=1,
                          profile_scratch_size=0, profile_scratch_align=1, launch_cooperative_grid=False,
                          launch_pdl=False)


def _launcher_ahead(compile_fn) -> threading.Thread | None:
    """A started thread building the C launcher of the kernel compile_fn compiles (Triton's
    AsyncCompileMode job: its `src` is the kernel's ASTSource), or None where the kernel takes a
    tensor descriptor (its launcher depends on the compiled metadata) or the job is not one."""
    try:
        from types import SimpleNamespace

        from triton.runtime import driver
        names = compile_fn.__code__.co_freevars
        src = dict(zip(names, (cell.cell_contents for cell in compile_fn.__closure__ or ())))["src"]
        if any("tensordesc" in str(kind) for kind in src.signature.values()):
            return None
        launcher_cls, metadata = driver.active.launcher_cls, SimpleNamespace(**_LAUNCHER_METADATA)
    except Exception:  # noqa: BLE001 -- Triton's internals differ: the launcher is built after the kernel
        return None

    def build():
        try:
            launcher_cls(src, metadata)
        except Exception:  # noqa: BLE001 -- built after the kernel instead (and any error reported there)
            pass

    thread = threading.Thread(target=build, name="attngen-launcher", daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def compile_only(workers: int, ignore_errors: bool = False):
    """Inside: this thread's Triton launches compile their kernels on `workers` threads and run
    nothing (outputs stay as allocated); on leaving, every compilation has finished. ignore_errors:
    a kernel that fails to compile is left out (its launch compiles it again and raises), else
    leaving raises its error."""
    from triton.runtime._async_compile import AsyncCompileMode, active_mode

    _install()
    token = _COMPILE_ONLY.set(True)
    mode = None
    try:
        with _Pool(workers, thread_name_prefix="attngen-compile") as pool:
            mode = AsyncCompileMode(pool, ignore_errors=ignore_errors)
            with mode:
                yield
    finally:
        _COMPILE_ONLY.reset(token)
        # Triton's AsyncCompileMode.__exit__ leaves itself active when a compilation raised: every later
        # call of this thread would then fail with "Another AsyncCompileMode is already active"
        if mode is not None and active_mode.get() is mode:
            active_mode.set(None)


def applies(device: torch.device) -> bool:
    """Whether calls on `device` compile their kernels (CUDA, not Triton's interpreter, not while
    torch.compile traces)."""
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and not torch.compiler.is_compiling())


def warm() -> None:
    """Once per process, where kernels compile (a CUDA GPU, not the interpreter) with a pool: start
    Triton's one-time work before a first compilation (triton_key, where warm_key has not started it,
    and the driver) on threads of their own, which first_call joins. Called when an op is made."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1" or threads() < 2:
        return
    _start("key", _triton_key)
    _start("driver", _driver)


def warm_key() -> None:
    """At `import attngen` when torch is already imported (attngen/__init__.py): triton_key on a thread
    of its own where an NVIDIA GPU may be present (its driver's device files), a second or so before an
    op is made. It touches no CUDA: CUDA's initialization (which reads CUDA_VISIBLE_DEVICES) stays with
    the program's own first CUDA call."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not any(map(os.path.exists, _NVIDIA_FILES)):
        return
    try:
        if threads() < 2:
            return
    except ValueError:   # a bad ATTNGEN_COMPILE_THREADS: the op reports it, not the import
        return
    _start("key", _triton_key)


_NVIDIA_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia/version")


def _start(name: str, target: Callable[[], None]) -> None:
    if name not in _WARM:
        _WARM[name] = threading.Thread(target=target, name=f"attngen-warm-{name}", daemon=True)
        _WARM[name].start()


def _triton_key() -> None:
    try:
        from triton.runtime.cache import triton_key
        triton_key()
    except Exception:  # noqa: BLE001 -- nothing done here: the first compilation does it (and reports any error)
        pass


def _driver() -> None:
    try:
        from triton.runtime import driver
        driver.active.get_current_target()
    except Exception:  # noqa: BLE001 -- as in _triton_key
        pass


def first_call(kind: Hashable, dry_run: Callable[[], None]) -> None:
    """Before the first call of `kind`: dry_run() (the call's launches, forward and backward) with
    compilation only, on the pool. Nothing when the kind was seen or the pool has one thread."""
    if kind in _SEEN:
        return
    workers = threads()
    if workers > 1:
        for thread in list(_WARM.values()):
            thread.join()
        with compile_only(workers):
            dry_run()
            # while the pool compiles: the import that the call's registered ops make on their first
            # call (torch.library's custom ops disable torch._dynamo around their functions)
            import torch._dynamo  # noqa: F401
    _SEEN.add(kind)


def dry_run(module, args: tuple, backward: bool, **backward_kw) -> None:
    """A generated module's forward(*args), the body of its op, and, with `backward`, its backward as
    autograd would call it (the gradient of o, and None for the other outputs: the op's autograd
    does not materialize zeros for them): inside compile_only(), the launches of a call's forward
    and backward. Both without the dispatcher (the registered ops' first call imports torch._dynamo:
    first_call makes that import while the pool compiles). The backward is called here, not through
    autograd, whose engine runs a CUDA backward on a thread of its own, outside compile_only();
    backward_kw as autograd would pass them (a linear module's decay_grad)."""
    with torch.no_grad():
        outs = module.forward(*args)
        if backward:
            n = len(module.SAVED_INPUTS)
            grads = (torch.empty_like(outs[0]), *[None] * (len(outs) - 1))
            module.backward(*args[:n], *args[n:], *outs, *grads, dispatch=False, **backward_kw)
