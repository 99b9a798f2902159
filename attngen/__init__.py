"""attngen: a compiler for attention kernels. See README.md."""
__version__ = "0.1.0"

from .runtime import Op, load
from .spec import Spec, SpecError, load_spec
from .reference import reference

__all__ = ["Op", "Spec", "SpecError", "load", "load_spec", "reference", "__version__"]
