"""Code generation: Spec -> Plan -> KernelSpec -> generated/<name>.py (Triton kernels,
launchers and the op's torch.library registration), rendered from templates/*.jinja.

Templates make no decisions: every structural choice arrives in the frozen `KernelSpec`
the planner builds; per-call choices (varlen, initial state, ...) are tl.constexpr flags.
"""
from __future__ import annotations

import atexit
import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import threading
import warnings
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import jinja2

from . import __version__, kernel_lib, planner, signature
from .spec import Spec

TEMPLATES = Path(__file__).with_name("templates")
REPO_GENERATED = Path(__file__).resolve().parent.parent / "generated"


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    # the ops' def lines, calls and schemas are rendered from signature.py's lists
    env.globals.update(wrap=signature.wrap, block=signature.block, string=signature.string)
    env.filters["piece"] = piece
    return env


# What an empty hook fragment renders as: _tidy drops the line it stands on. A whitespace character to
# Python's str.strip (the unit separator), so that where a macro's output ends in it, a caller's `trim`
# takes it with the newlines before it, as it takes an empty part's
_NO_PIECE = "\x1f"


def piece(text: str, indent: int) -> str:
    """A hook's fragment on a template line of its own, `{{ fragment | piece(n) }}` at n spaces: its
    later lines indented to match the first (Jinja's indent filter); an empty fragment (a rule or
    decay without that piece) leaves no line at all. Trailing blanks are not part of it (a macro whose
    body ends in a block tag leaves a newline)."""
    text = str(text).rstrip()
    return text.replace("\n", "\n" + " " * indent) if text else _NO_PIECE


def render(spec: Spec) -> str:
    """The generated module's source: a pure function of the spec and attngen's version. Rendered
    twice: the second time with the import of the attngen.kernel_lib names the first one's code calls."""
    ks = planner.kernel_spec(spec)
    sig = signature.signatures(spec.attention, spec.decay)
    template = _env().get_template("module.py.jinja")
    helpers = kernel_lib_calls(template.render(ks=ks, sig=sig, version=__version__, helpers=()))
    return _tidy(template.render(ks=ks, sig=sig, version=__version__, helpers=helpers))


# One pass over a module's source: its strings and comments (group 1, skipped) or a kernel_lib name as
# a word of its code (group 2). A tokenizer reads the same names and takes 50 ms a module, this 5: the
# load path renders every module it imports (load_module).
_KERNEL_LIB_WORDS = re.compile(
    r"""(\"\"\"[\s\S]*?\"\"\"|'''[\s\S]*?'''|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|#[^\n]*)"""
    r"|\b(" + "|".join(kernel_lib.__all__) + r")\b")


def kernel_lib_calls(source: str) -> tuple[str, ...]:
    """The names of attngen.kernel_lib that Python source uses (its code: comments and strings are not
    looked at), sorted."""
    return tuple(sorted({m.group(2) for m in _KERNEL_LIB_WORDS.finditer(source) if m.group(2)}))


def _tidy(source: str) -> str:
    """Strip trailing blanks, drop the lines of empty hook fragments (piece) and collapse runs of blank
    lines that optional template parts leave."""
    lines, blank = [], 0
    for line in source.splitlines():
        if _NO_PIECE in line:
            if line.replace(_NO_PIECE, "").strip():
                raise ValueError(f"a template line holds an empty hook fragment beside other text: {line!r}")
            continue
        line = line.rstrip()
        blank = blank + 1 if not line else 0
        if blank <= 2:
            lines.append(line)
    return "\n".join(lines).strip("\n") + "\n"


def compile_to(spec: Spec, out_dir: Path, source: bytes | None = None) -> Path:
    """Write out_dir/<name>.py unless it already holds this rendering (source: the spec's rendering,
    where the caller has it); whatever else it holds (an older rendering, bytes that are not UTF-8) is
    replaced."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{spec.name}.py"
    source = render(spec).encode() if source is None else source
    if not path.exists() or path.read_bytes() != source:
        write_atomic(path, source)
    return path


def write_atomic(path: Path, data: bytes) -> None:
    """Write through a temporary file in the same directory, then os.replace: another process
    importing the module meanwhile reads the old file or the new one, never part of one, and a
    write that fails (a full disk) leaves the old file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def cache_key(source: bytes) -> str:
    """The cache's name for one rendering of a spec's module (a digest of its bytes)."""
    return hashlib.sha256(source).hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("ATTNGEN_CACHE", Path.home() / ".cache" / "attngen"))


# Where modules go when the cache directory cannot be written (a read-only home): one temporary
# directory per process, removed at exit; each unwritable directory is warned about once.
_fallback_dir: Path | None = None
_unwritable: set[Path] = set()


def _fallback_cache(directory: Path, error: OSError) -> Path:
    global _fallback_dir
    if _fallback_dir is None:
        _fallback_dir = Path(tempfile.mkdtemp(prefix="attngen-"))
        atexit.register(shutil.rmtree, _fallback_dir, ignore_errors=True)
    if directory not in _unwritable:
        _unwritable.add(directory)
        warnings.warn(f"attngen: cannot write generated modules to the cache directory {directory} ({error}); "
                      f"this process renders them into {_fallback_dir} instead, and the next renders them "
                      "again. Set ATTNGEN_CACHE to a writable directory to keep them.")
    return _fallback_dir


# Generated modules by import name (spec name and hash), imported once per process and never
# dropped: importing one registers its ops with torch.library under that name, and importing it
# again would register them over the live ones that earlier ops still call (a crash inside the
# dispatcher). A module imported directly (not through here) puts itself in sys.modules under that
# name and is used as it is. The lock makes one thread import a module while the others wait for it.
_MODULES: dict[str, ModuleType] = {}
_MODULES_LOCK = threading.Lock()


def module_name(spec: Spec) -> str:
    """The import name of a spec's generated module (its name and hash)."""
    return f"attngen_generated_{spec.name}_{spec.hash}"


def load_edited_module(spec: Spec, path: Path) -> ModuleType:
    """Import the file at path, an edited rendering of a spec's module, as that spec's module: ops made
    after it run its kernels (bench/probe_launch.py and bench/compile_time.py, --module)."""
    return _import(module_name(spec), Path(path).resolve())


def load_module(spec: Spec) -> ModuleType:
    """A spec's generated module, imported on first use: the committed generated/<name>.py when
    it is this exact rendering, else a fresh rendering in the cache directory (Triton needs a file)."""
    name = module_name(spec)
    with _MODULES_LOCK:
        if name not in _MODULES:
            _MODULES[name] = sys.modules[name] if name in sys.modules else _import(name, _module_path(spec))
        return _MODULES[name]


# Committed modules already warned about for differing from their fresh rendering.
_DIFFERING: set[Path] = set()


def _module_path(spec: Spec) -> Path:
    committed = REPO_GENERATED / f"{spec.name}.py"
    source = render(spec).encode()
    if committed.exists() and committed.read_bytes() == source:
        return committed
    directory = cache_dir()
    # a directory per spec and rendering: processes of two attngen versions sharing the cache (two
    # environments at once) never overwrite each other's module between one's write and its import
    rendering = cache_key(source)
    try:
        path = compile_to(spec, directory / spec.hash / rendering, source)
    except OSError as error:
        path = compile_to(spec, _fallback_cache(directory, error) / spec.hash / rendering, source)
    if committed.exists() and committed not in _DIFFERING and _rendered_spec_hash(committed) == spec.hash:
        _DIFFERING.add(committed)
        warnings.warn(f"attngen: {committed} differs from a fresh rendering of spec {spec.name!r} "
                      f"(hash {spec.hash}; edited by hand, or rendered by another attngen version); "
                      f"loading {path} instead. Run `attngen compile` to render it again.")
    return path


def _rendered_spec_hash(path: Path) -> str | None:
    """The SPEC_HASH line of a generated module: whether a differing file was rendered from the
    same spec (a hand edit) or from another spec of that name."""
    found = re.search(r'^SPEC_HASH = "([0-9a-f]+)"$', path.read_text(errors="replace"), re.MULTILINE)
    return found.group(1) if found else None


def _import(name: str, path: Path) -> ModuleType:
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
