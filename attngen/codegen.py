"""Code generation: Spec -> Plan -> KernelSpec -> generated/<name>.py (Triton kernels,
launchers and the op's torch.library registration), rendered from templates/*.jinja.

Templates make no decisions: every structural choice arrives in the frozen `KernelSpec`
the planner builds; per-call choices (varlen, initial state, ...) are tl.constexpr flags.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import jinja2

from . import __version__, planner
from .spec import Spec

TEMPLATES = Path(__file__).with_name("templates")
REPO_GENERATED = Path(__file__).resolve().parent.parent / "generated"


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


def render(spec: Spec) -> str:
    """The generated module's source: a pure function of the spec and attngen's version."""
    ks = planner.kernel_spec(spec)
    source = _env().get_template("module.py.jinja").render(ks=ks, version=__version__)
    return _tidy(source)


def _tidy(source: str) -> str:
    """Strip trailing blanks and collapse runs of blank lines that optional template parts leave."""
    lines, blank = [], 0
    for line in source.splitlines():
        line = line.rstrip()
        blank = blank + 1 if not line else 0
        if blank <= 2:
            lines.append(line)
    return "\n".join(lines).strip("\n") + "\n"


def compile_to(spec: Spec, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{spec.name}.py"
    source = render(spec)
    if not path.exists() or path.read_text() != source:
        path.write_text(source)
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("ATTNGEN_CACHE", Path.home() / ".cache" / "attngen"))


@lru_cache(maxsize=128)
def load_module(spec: Spec) -> ModuleType:
    """Import a spec's generated module: the committed generated/<name>.py when it is this
    exact rendering, else a fresh rendering in the cache directory (Triton needs a file)."""
    source = render(spec)
    committed = REPO_GENERATED / f"{spec.name}.py"
    if committed.exists() and committed.read_text() == source:
        path = committed
    else:
        path = compile_to(spec, cache_dir() / spec.hash)
    name = f"attngen_generated_{spec.name}_{spec.hash}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module
