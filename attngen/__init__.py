"""attngen: a compiler for attention kernels. See README.md."""
__version__ = "0.1.0"

from .spec import Spec, SpecError, load_spec

__all__ = ["Op", "Spec", "SpecError", "StateCache", "load", "load_spec", "__version__"]

# The op needs torch, whose import takes seconds: it is imported on first use, so that
# `import attngen` (and `attngen --help`) stays cheap. The interpreter is the submodule
# attngen.reference (its function attngen.reference.reference); the package no longer binds
# the function over the module's name, which made `from . import reference` ambiguous.
_LAZY = {"Op": "runtime", "StateCache": "serving", "load": "runtime"}

# With torch already imported (`import torch`, then `import attngen`), Triton's hash of its own library,
# which its first compilation waits for, starts now on a thread of its own (compiling.warm_key; nothing
# of CUDA is touched). Without torch the import stays cheap and the op starts it (compiling.warm).
import sys as _sys  # noqa: E402
if "torch" in _sys.modules:
    from . import compiling as _compiling
    _compiling.warm_key()


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'attngen' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
