"""Launch knobs per GPU: the tables of tuned launches, their lookup per call, and the search that
fills them (`attngen tune`).

The planner owns the knobs (planner.ChunkedLaunch, planner.SoftmaxLaunch), their defaults and
the rules that fit them to a call; this module only finds which values a call takes. A table is
a JSON file for one GPU, compute capability and Triton version: shipped with the package
(attngen/tables/) or written by `attngen tune` into the user's directory ($ATTNGEN_TUNE_DIR,
default $ATTNGEN_CACHE/tune; it overrides a shipped entry of the same key). Its entries are keyed by
kernel family, spec hash, dtype and a shape bucket (bucket()). Per call on a CUDA device:
- a hit is used, with no search;
- a miss takes the launch a shipped table of a sibling GPU holds for the bucket (another GPU of the
  same compute capability, with the same Triton: the H100 and the H200 share sm_90, its 132 SMs and
  shared memory, so one's launches compile and run right on the other, and they are nearer its best
  than the planner's defaults), else the nearest tuned bucket of the same head dims in this GPU's
  tables and the siblings' (this GPU's on a tie; its state passes' segments the policy's for the
  call, carried(): a long sequence is split where its programs leave SMs idle,
  kernel_lib.chunked_state_segments), else the planner's default, and
  warns once per bucket with the `attngen tune` command that fills it; with ATTNGEN_AUTOTUNE=1 it
  searches instead (seconds to minutes, once: the winner is written to the user's table);
- a call held to a chunk (chunk_size=, or the parallel form's one chunk) takes a table's launch
  at that chunk, or the default, silently.
Tables made on another GPU or Triton version are ignored with a warning (the shipped ones of
other GPUs silently, but as siblings above), and so are entries whose launch knobs are not this version's (a table an
earlier attngen wrote); a table that cannot be read is an error naming its file.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from . import codegen, compiling, planner
from .inputs import Call
from .signature import LINEAR_OP, SOFTMAX_OP
from .spec import Spec

TABLE_FORMAT = 1
# A miss takes a tuned bucket of the same head dims at most this many octaves away in T, Tk and BH
# (a factor of 4 in each): farther, a launch tuned for another regime (prefill for decode: no
# split of the keys) can be slower than the defaults.
NEAREST_OCTAVES = 2
SHIPPED = Path(__file__).with_name("tables")


class TableError(ValueError):
    """A tuning table that cannot be used (unreadable, not JSON, wrong fields or values)."""


class StaleEntry(ValueError):
    """A table entry whose launch knobs are another attngen version's (a knob added or removed since)."""


def tune_dir() -> Path:
    """The user's tables: $ATTNGEN_TUNE_DIR, else the tune/ directory of attngen's cache."""
    env = os.environ.get("ATTNGEN_TUNE_DIR")
    return Path(env) if env else codegen.cache_dir() / "tune"


def autotuning() -> bool:
    value = os.environ.get("ATTNGEN_AUTOTUNE", "0")
    if value not in ("0", "1"):
        raise ValueError(f"ATTNGEN_AUTOTUNE: value {value!r} is not allowed; allowed: 0, 1")
    return value == "1"


# ---------------------------------------------------------------------------- keys
@dataclasses.dataclass(frozen=True)
class Machine:
    """What a table is valid for: the GPU, its compute capability and the Triton compiling for it."""

    gpu: str            # torch.cuda.get_device_name
    capability: str     # "9.0"
    triton: str         # triton.__version__

    def describe(self) -> str:
        return f"{self.gpu} (compute capability {self.capability}) with Triton {self.triton}"

    def file_name(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.gpu.lower()).strip("-") or "gpu"
        return f"{slug}-sm{self.capability.replace('.', '')}-triton{self.triton}.json"


@functools.lru_cache(maxsize=None)
def _cuda_machine(index: int) -> Machine:
    import triton
    major, minor = torch.cuda.get_device_capability(index)
    return Machine(torch.cuda.get_device_name(index), f"{major}.{minor}", triton.__version__)


def machine(device: torch.device | str) -> Machine | None:
    """The machine of a device; None off CUDA (Triton's interpreter has no tables)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_machine(device.index if device.index is not None else torch.cuda.current_device())


def multiprocessors(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device (32 elsewhere: the interpreter's small tests then
    split the keys as a GPU would)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 32
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclasses.dataclass(frozen=True)
class Bucket:
    """The shape a launch is tuned for, each size rounded up to a power of two: T the longest
    sequence (softmax: of queries) and Tk of keys (T for linear attention), BH sequences x heads,
    K and V the head dims' lanes (planner.lanes)."""

    T: int
    Tk: int
    BH: int
    K: int
    V: int

    def distance(self, other: Bucket) -> tuple[int, int]:
        """How far apart two buckets of the same head dims are: the most octaves between their T,
        Tk or BH, then the octaves between them all."""
        octaves = [abs(getattr(self, n).bit_length() - getattr(other, n).bit_length()) for n in ("T", "Tk", "BH")]
        return max(octaves), sum(octaves)

    def describe(self) -> str:
        keys = "" if self.Tk == self.T else f" Tk {self.Tk}"
        return f"T {self.T}{keys} B*H {self.BH} K {self.K} V {self.V}"


def bucket(call: Call) -> Bucket:
    T, Tk = (call.max_len, call.max_len) if call.varlen else (call.q_len, call.k_len)
    return Bucket(planner.lanes(T), planner.lanes(Tk), planner.pow2(call.num_seqs * call.heads),
                  planner.lanes(call.head_dim), planner.lanes(call.value_dim))


@dataclasses.dataclass(frozen=True)
class Key:
    kernel: str         # the launch family (planner.LAUNCHES)
    spec_hash: str
    dtype: str          # of q, k, v: float32 | bfloat16 | float16 | float64
    bucket: Bucket


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def key(spec: Spec, family: str, call: Call, dtype: torch.dtype) -> Key:
    return Key(family, spec.hash, dtype_name(dtype), bucket(call))


@dataclasses.dataclass(frozen=True)
class Entry:
    """A table's row: the winning launch of a key, with what the search measured."""

    key: Key
    spec: str                   # the spec's name, for people reading the table
    launch: planner.Launch
    shape: str                  # the shape it was tuned at, B,T,H,K,V[,Tq]
    ms: dict[str, float | None] | None = None           # its time per pass, milliseconds: fwd, bwd (forward + backward)
    default_ms: dict[str, float | None] | None = None   # the default launch's

    def to_json(self) -> dict:
        b = self.key.bucket
        return {"kernel": self.key.kernel, "spec": self.spec, "spec_hash": self.key.spec_hash,
                "dtype": self.key.dtype, "T": b.T, "Tk": b.Tk, "BH": b.BH, "K": b.K, "V": b.V,
                "launch": dataclasses.asdict(self.launch), "shape": self.shape, "ms": self.ms,
                "default_ms": self.default_ms}


@dataclasses.dataclass(frozen=True)
class Table:
    machine: Machine
    entries: tuple[Entry, ...]
    stale: int = 0      # entries left out: their launch knobs are another attngen version's (StaleEntry)

    def to_json(self) -> dict:
        return {"attngen_tuning_table": TABLE_FORMAT, "gpu": self.machine.gpu,
                "capability": self.machine.capability, "triton": self.machine.triton,
                "entries": [e.to_json() for e in sorted(self.entries, key=_entry_order)]}


def _entry_order(entry: Entry):
    k = entry.key
    return k.kernel, entry.spec, k.spec_hash, k.dtype, dataclasses.astuple(k.bucket)


# ---------------------------------------------------------------------------- files
def read_table(path: Path) -> Table:
    """A table file, checked whole: a TableError names the file and what is wrong."""
    def bad(what: str) -> TableError:
        return TableError(f"tuning table {path}: {what}; delete the file, or run `attngen tune` to write it again")

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"is not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("attngen_tuning_table") != TABLE_FORMAT:
        raise bad(f"is not an attngen tuning table of format {TABLE_FORMAT} "
                  f"(expected an object with \"attngen_tuning_table\": {TABLE_FORMAT})")
    header = {}
    for name in ("gpu", "capability", "triton"):
        if not isinstance(data.get(name), str):
            raise bad(f"field {name!r} must be a string, got {data.get(name)!r}")
        header[name] = data[name]
    rows = data.get("entries")
    if not isinstance(rows, list):
        raise bad(f"field 'entries' must be a list, got {type(rows).__name__}")
    entries, stale = [], 0
    for i, row in enumerate(rows):
        try:
            entries.append(_entry(row))
        except StaleEntry:
            stale += 1
        except (TypeError, ValueError, KeyError) as e:
            raise bad(f"entry {i}: {e}") from None
    return Table(Machine(**header), tuple(entries), stale)


def _entry(row) -> Entry:
    if not isinstance(row, dict):
        raise TypeError(f"expected an object, got {type(row).__name__}")
    kernel = row["kernel"]
    if kernel not in planner.LAUNCHES:
        raise ValueError(f"kernel {kernel!r} is not a launch family; allowed: {', '.join(planner.LAUNCHES)}")
    sizes = {}
    for name in ("T", "Tk", "BH", "K", "V"):
        value = row[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"{name}: expected a power of two, got {value!r}")
        sizes[name] = value
    for name in ("spec", "spec_hash", "dtype", "shape"):
        if not isinstance(row[name], str):
            raise TypeError(f"{name}: expected a string, got {row[name]!r}")
    if row["dtype"] not in ("float32", "bfloat16", "float16", "float64"):
        raise ValueError(f"dtype {row['dtype']!r} is not allowed; allowed: float32, bfloat16, float16, float64")
    cls = planner.LAUNCHES[kernel]
    launch = row["launch"]
    if not isinstance(launch, dict):
        raise TypeError(f"launch: expected an object of the knobs {', '.join(cls.knobs())}, got {launch!r}")
    missing = set(cls.knobs()) - set(launch)
    if missing and missing <= set(cls.INHERITED) and set(launch) <= set(cls.knobs()):
        # an entry written before these knobs: each takes the value of the knob that launched its kernels
        # then, or the value it had then
        was = {name: cls.INHERITED[name] for name in missing}
        launch = {**launch, **{name: launch[v] if isinstance(v, str) else v for name, v in was.items()}}
    if set(launch) != set(cls.knobs()):
        raise StaleEntry(f"launch knobs {', '.join(launch)}; this version's: {', '.join(cls.knobs())}")
    times = [row.get(n) for n in ("ms", "default_ms")]
    for name, t in zip(("ms", "default_ms"), times):
        if t is not None and not (isinstance(t, dict) and all(
                p in ("fwd", "bwd") and (ms is None or (isinstance(ms, (int, float)) and not isinstance(ms, bool)))
                for p, ms in t.items())):
            raise TypeError(f"{name}: expected null or milliseconds per pass (fwd, bwd), got {t!r}")
    return Entry(Key(kernel, row["spec_hash"], row["dtype"], Bucket(**sizes)), row["spec"], cls(**launch),
                 row["shape"], *times)


def write_table(path: Path, table: Table) -> None:
    """The table as JSON, one entry per line (a diff shows the keys whose launch changed)."""
    data = table.to_json()
    rows = data.pop("entries")
    text = json.dumps(data)[:-1] + ', "entries": [\n' + ",\n".join(json.dumps(r) for r in rows) + "\n]}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    codegen.write_atomic(path, text.encode())


def record(entries: list[Entry], mach: Machine, directory: Path | None = None) -> Path:
    """Write entries into the machine's table in `directory` (default: the user's), over the
    entries of the same keys; the lookups of this process see them."""
    path = (directory or tune_dir()) / mach.file_name()
    kept = read_table(path).entries if path.exists() else ()
    new = {e.key: e for e in entries}
    write_table(path, Table(mach, tuple(e for e in kept if e.key not in new) + tuple(new.values())))
    _tables.cache_clear()
    _sibling_tables.cache_clear()
    _remembered.cache_clear()
    return path


# Warnings already given in this process (foreign tables, misses).
_WARNED: set = set()


def _warn_once(what, message: str) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(message, stacklevel=_outside_attngen())


def _outside_attngen() -> int:
    """The stacklevel of the first frame outside the attngen package, so that a warning names the
    user's line (the call of the op) rather than a line of attngen's own."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1   # level 1: the function calling warnings.warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


@functools.lru_cache(maxsize=16)
def _tables(mach: Machine, user_dir: Path) -> dict[Key, tuple[Entry, Path]]:
    """Every entry for a machine, by key: the shipped tables', then the user's over them."""
    found: dict[Key, tuple[Entry, Path]] = {}
    for directory, shipped in ((SHIPPED, True), (user_dir, False)):
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
            table = read_table(path)
            if table.machine != mach:
                # shipped tables of other GPUs are for those GPUs; a stale one of this GPU, or any
                # other table the user has, is worth a word
                if not shipped or table.machine.gpu == mach.gpu:
                    _warn_once(("foreign", path), f"attngen: ignoring the tuning table {path}: it was tuned on "
                               f"{table.machine.describe()}, and this is {mach.describe()}. `attngen tune` "
                               "tunes for this one.")
                continue
            if table.stale:
                _warn_once(("stale", path), f"attngen: ignoring {table.stale} of the {table.stale + len(table.entries)} "
                           f"entries of the tuning table {path}: their launch knobs are another attngen version's "
                           "(knobs were added or removed since they were tuned); `attngen tune` tunes them again.")
            for entry in table.entries:
                found[entry.key] = (entry, path)
    return found


def tables(mach: Machine) -> dict[Key, tuple[Entry, Path]]:
    return _tables(mach, tune_dir())


def sibling_tables(mach: Machine) -> dict[Key, tuple[Entry, Path]]:
    """The entries of the shipped tables of sibling GPUs: another GPU of the same compute capability
    and Triton version (tables in file-name order, the first holding a key gives it)."""
    return _sibling_tables(mach, SHIPPED)


@functools.lru_cache(maxsize=16)
def _sibling_tables(mach: Machine, shipped: Path) -> dict[Key, tuple[Entry, Path]]:
    found: dict[Key, tuple[Entry, Path]] = {}
    for path in sorted(shipped.glob("*.json")) if shipped.is_dir() else ():
        table = read_table(path)
        other = table.machine
        if other.gpu != mach.gpu and (other.capability, other.triton) == (mach.capability, mach.triton):
            for entry in table.entries:
                found.setdefault(entry.key, (entry, path))
    return found


# ---------------------------------------------------------------------------- lookup
@dataclasses.dataclass(frozen=True)
class Chosen:
    launch: planner.Launch
    source: str         # where it comes from, in words


def tune_command(spec: Spec, call: Call, dtype: torch.dtype) -> str:
    """The `attngen tune` command line that tunes a call's bucket."""
    path = spec.source if spec.source.endswith((".yaml", ".yml")) else f"<the YAML file of spec {spec.name!r}>"
    T, Tk = (call.max_len, call.max_len) if call.varlen else (call.q_len, call.k_len)
    shape = f"{call.num_seqs},{Tk},{call.heads},{call.head_dim},{call.value_dim}" + (f",{T}" if T != Tk else "")
    return f"attngen tune {path} --shapes {shape} --dtype {dtype_name(dtype)}"


def nearest(want: Key, keys) -> Key | None:
    """The key among `keys` (other than want) of want's kernel, spec, dtype and head dims whose bucket is
    nearest want's, at most NEAREST_OCTAVES away in each size (ties to the smallest bucket); None if none."""
    near = [(k.bucket.distance(want.bucket), dataclasses.astuple(k.bucket), k) for k in keys
            if k != want and (k.kernel, k.spec_hash, k.dtype, k.bucket.K, k.bucket.V) ==
            (want.kernel, want.spec_hash, want.dtype, want.bucket.K, want.bucket.V)
            and k.bucket.distance(want.bucket)[0] <= NEAREST_OCTAVES]
    return min(near)[2] if near else None


def carried(launch: planner.Launch) -> planner.Launch:
    """A launch tuned for one bucket as another bucket takes it: its knobs, but for the sequential
    passes' segments, which the policy gives the call (kernel_lib.chunked_state_segments: a sequence
    is split where its programs leave SMs idle). A count tuned for a bucket whose programs fill the GPU
    (1: no split) would leave a long single sequence's pass on a few SMs: deltanet B1 T32768 H16 K = V =
    128 bf16 on an H100, fwd+bwd 6.806 ms with B4 T8192's tuned segments=1 (BENCHMARKS.md 2026-12-06c)."""
    return dataclasses.replace(launch, segments=0) if isinstance(launch, planner.ChunkedLaunch) else launch


def resolve(spec: Spec, family: str, call: Call, dtype: torch.dtype, mach: Machine, default: planner.Launch,
            chunk: int | None = None, search: Callable[[], Entry] | None = None) -> Chosen:
    """The launch of a call on a machine from its tables (the module docstring's rules). default:
    the planner's; search: runs the search of this call's bucket and returns its entry (called on a
    miss with ATTNGEN_AUTOTUNE=1)."""
    fit = functools.partial(planner.fit_launch, family, spec, call, dtype, chunk=chunk)
    want = key(spec, family, call, dtype)
    found = tables(mach)
    if want in found:
        entry, path = found[want]
        return Chosen(fit(launch=entry.launch), f"tuned ({path})")
    if chunk is None and search is not None and autotuning():
        entry = search()
        return Chosen(fit(launch=entry.launch), "tuned now (ATTNGEN_AUTOTUNE=1)")
    # a sibling GPU's entry for this very bucket, else the nearest bucket of this GPU's tables and the
    # siblings' (this GPU's on a tie)
    siblings = sibling_tables(mach)
    near = sibling = None
    if want in siblings:
        sibling = want
    else:
        near, sibling = nearest(want, found), nearest(want, siblings)
        if near and sibling:
            if want.bucket.distance(near.bucket) <= want.bucket.distance(sibling.bucket):
                sibling = None
            else:
                near = None
    if near:
        entry, path = found[near]
        chosen = Chosen(fit(launch=carried(entry.launch)), f"tuned for the nearest bucket, {entry.key.bucket.describe()} ({path})")
        using = "nearest tuned bucket"
    elif sibling:
        entry, path = siblings[sibling]
        bucket_ = "" if sibling == want else f" for the nearest bucket, {entry.key.bucket.describe()},"
        chosen = Chosen(fit(launch=entry.launch if sibling == want else carried(entry.launch)),
                        f"tuned{bucket_} on a sibling GPU ({path})")
        using = f"launch tuned{bucket_} on a sibling GPU of the same compute capability and Triton ({path.name})"
    else:
        chosen = Chosen(fit(launch=default), f"default (no tuned {family} launch for this bucket)")
        using = "defaults"
    if chunk is None:
        _warn_once(("miss", want, mach),
                   f"attngen: no tuned {family} launch of spec {spec.name!r} for {dtype_name(dtype)}, "
                   f"{want.bucket.describe()} on {mach.describe()}; using the {using}. To tune it: "
                   f"`{tune_command(spec, call, dtype)}` (or set ATTNGEN_AUTOTUNE=1 to tune on a miss)")
    return chosen


def choose(spec: Spec, family: str, call: Call, dtype: torch.dtype, device: torch.device | str,
           chunk: int | None = None) -> Chosen:
    """The launch of a kernel family for a call on a device (the chunk held to `chunk` if given)."""
    default = planner.default_launch(family, spec, call, dtype, multiprocessors(device))
    mach = machine(device)
    if mach is None:
        return Chosen(planner.fit_launch(family, spec, call, dtype, default, chunk),
                      f"default (no tuning tables off CUDA: {torch.device(device).type} tensors)")
    search = functools.partial(_search_call, spec, call, dtype, device, mach)
    return resolve(spec, family, call, dtype, mach, default, chunk, search)


# Call's fields in order: a call travels to _launch_ints as the tuple of their values.
_CALL_FIELDS = tuple(f.name for f in dataclasses.fields(Call))
# The environment a launch depends on besides the call: the user's tables and ATTNGEN_AUTOTUNE.
_ENVIRONMENT = ("ATTNGEN_TUNE_DIR", "ATTNGEN_CACHE", "ATTNGEN_AUTOTUNE")


def launch_ints(spec: Spec, family: str, call: Call, dtype: torch.dtype, device: torch.device,
                chunk: int | None = None, k_len: int | None = None) -> tuple[int, ...]:
    """choose()'s launch as the generated op takes it (Launch.ints), remembered per call's sizes:
    a call looks it up once (a decode step would otherwise spend more on it than on its kernels).
    k_len: the keys the kernels read, where not the call's (a key/value cache's rows)."""
    sizes = tuple(k_len if n == "k_len" and k_len is not None else getattr(call, n) for n in _CALL_FIELDS)
    return _launch_ints(spec, family, sizes, dtype, device, chunk)


def _launch_ints(spec: Spec, family: str, call: tuple, dtype: torch.dtype, device: torch.device,
                 chunk: int | None) -> tuple[int, ...]:
    # torch.compile calls this while tracing and keeps the result as a constant (it reads files and
    # warns: nothing to trace); the call comes in and the launch goes out as plain values, the only
    # ones it passes
    return _remembered(spec, family, call, dtype, device, chunk, tuple(map(os.environ.get, _ENVIRONMENT)))


# torch.compiler.assume_constant_result(fn) marks fn with this attribute, which torch.compile's tracer
# reads, and returns it; the decorator itself imports torch._dynamo (a second of a fresh process's
# `attngen.load`, before any call), so the mark is set here (tests/test_compile.py holds it to the
# decorator's)
DYNAMO_CONSTANT = "_dynamo_marked_constant"
setattr(_launch_ints, DYNAMO_CONSTANT, True)


@functools.lru_cache(maxsize=4096)
def _remembered(spec: Spec, family: str, call: tuple, dtype: torch.dtype, device: torch.device, chunk: int | None,
                environment: tuple) -> tuple[int, ...]:
    # the environment is part of the key: a change of the user's directory or ATTNGEN_AUTOTUNE is seen
    return tuple(choose(spec, family, Call(*call), dtype, device, chunk).launch.ints())


def _search_call(spec: Spec, call: Call, dtype: torch.dtype, device, mach: Machine) -> Entry:
    from .testing import Shape, format_shape
    T, Tk = (call.max_len, call.max_len) if call.varlen else (call.q_len, call.k_len)
    shape = Shape(batch=call.num_seqs, q_len=T, k_len=Tk if Tk != T else None, heads=call.heads,
                  head_dim=call.head_dim, value_dim=call.value_dim)
    warnings.warn(f"attngen: ATTNGEN_AUTOTUNE=1: tuning spec {spec.name!r} at {format_shape(shape)} "
                  f"{dtype_name(dtype)} on {mach.describe()} (once; the winner goes to {tune_dir()})", stacklevel=4)
    return tune(spec, [shape], dtype, device, mach=mach, report=lambda line: None)[0]


# ---------------------------------------------------------------------------- search
@dataclasses.dataclass(frozen=True)
class Trial:
    """One launch timed for one pass (fwd: the forward; bwd: the forward and the backward), or why it
    was not."""

    launch: planner.Launch
    pass_: str
    ms: float | None
    error: str | None = None
    again: bool = False  # a timing again of a launch timed before (CONFIRM)


@dataclasses.dataclass(frozen=True)
class Found:
    """A search's result: the best launch, every trial, and per pass the default's and the best's
    times (None where that launch did not run)."""

    best: planner.Launch
    trials: tuple[Trial, ...]
    default_ms: dict[str, float | None]
    best_ms: dict[str, float | None]


# A search's best launch replaces the default only this much faster (relative) in the last pass, or in a
# pass before it at no cost to the last (stands): the same launch timed in two runs of do_bench on the H200
# differs by up to about 1%.
MIN_GAIN = 0.02

# How many more times the best launch and the default are each timed in each pass, in turn, before the best
# replaces the default (stands): a timing can be far off (the same launch 1.759 and 2.132 ms forward + backward
# in one process on an H100, BENCHMARKS.md 2026-12-06, sixth run), and each stands at the median of its
# timings, so no single one decides.
CONFIRM = 2

# What a CUDA error that leaves the process's context unusable says: every kernel after it fails
# (an illegal address from a miscompiled launch; Triton 3.6 at bf16 wgmma dots, BENCHMARKS.md).
CONTEXT_LOST = ("illegal memory access", "illegal address", "misaligned address", "unspecified launch failure")


def search(default: planner.Launch, fit: Callable[[planner.Launch], planner.Launch],
           measure: Callable[[planner.Launch, str], float], passes: tuple[str, ...] = ("fwd", "bwd"),
           report: Callable[[str], None] = print, rounds: int = 2, budget_s: float | None = None,
           prepare: Callable[[list[planner.Launch], str], None] | None = None,
           seeds: tuple[planner.Launch, ...] = ()) -> Found:
    """The fastest launch found from `default` by coordinate descent: per pass, each of its knobs in
    turn takes each of its search values (planner knob metadata, fitted to the call) with the
    others at the best so far, then each kernel's tile and warps (the launch class's TILES) every
    combination of theirs together, for up to `rounds` rounds while one improves. measure(launch, pass)
    -> milliseconds; an exception (a launch that does not compile, runs out of shared memory or
    gives other outputs) skips that launch, reported; one that loses the CUDA context (CONTEXT_LOST)
    stops the search with a RuntimeError. budget_s: seconds of search, shared by the passes (each
    pass's share is what is left over the passes left); no knob is started past a pass's share, and
    a knob started has each of its values timed (the best so far stands; each pass's default is still
    timed). prepare(launches, pass),
    when given, runs before a knob's new launches are timed, with all of them (e.g. to compile
    their kernels side by side); what it leaves undone, measure does. seeds: launches timed in each
    pass beside the default (fitted; those `attngen tune --seed` gives, the table's entry being searched
    again, and its nearest bucket's):
    one that is faster is the best so far, so that a search never ends on a launch slower than the entry
    it replaces or the one the runtime would take without it. After the first pass each seed's own knobs of
    the pass are also timed over the best of the passes before."""
    cls = type(default)
    best, trials = default, []
    default_ms, best_ms, best_of = {}, {}, {}
    end = time.monotonic() + budget_s if budget_s is not None else math.inf

    def trial(launch: planner.Launch, pass_: str, label: str, again: bool = False) -> float:
        try:
            t = Trial(launch, pass_, float(measure(launch, pass_)), again=again)
        except Exception as e:  # noqa: BLE001 -- any failure of a candidate skips it, reported
            lines = str(e).strip().splitlines()
            t = Trial(launch, pass_, None, f"{type(e).__name__}: {lines[0][:160] if lines else ''}", again)
            if any(word in str(e) for word in CONTEXT_LOST):
                report(f"  {label} {_changed(default, launch)}: {t.error}")
                raise RuntimeError(
                    f"launch {launch.describe()}: {t.error}. An illegal address (a miscompiled launch) leaves "
                    "this process's CUDA context unusable: the search stops here, nothing after it could run; "
                    "nothing is recorded for this shape") from e
        trials.append(t)
        report(f"  {label} {_changed(default, launch)}: "
               + (f"{t.ms:.3f} ms" if t.error is None else f"skipped, {t.error}"))
        return t.ms if t.ms is not None else math.inf

    for i, pass_ in enumerate(passes):
        now = time.monotonic()
        deadline = now + max(0.0, end - now) / (len(passes) - i) if end < math.inf else math.inf
        names = cls.searched(pass_)
        default_ms[pass_] = trial(default, pass_, f"{pass_} [default]")
        best_ms[pass_] = default_ms[pass_] if best == default else trial(best, pass_, f"{pass_} [best so far]")
        seen = {best, default}
        fitted = tuple(dict.fromkeys(fit(seed) for seed in seeds))
        # after the first pass, each seed's own knobs of this pass over the best so far too: a seed wins a
        # pass as a whole, which would drop the knobs the passes before found (retnet B1 T32768 on the H100:
        # the forward's outputs in the state pass, 0.558 ms against the seed's 0.597, lost to the seed's
        # backward knobs, BENCHMARKS.md 2026-12-06, sixth run)
        own = cls.knobs(pass_) if i > 0 else ()
        crossed = tuple(fit(dataclasses.replace(best, **{n: getattr(seed, n) for n in own})) for seed in fitted if own)
        for seed, label in [(s, "seed") for s in fitted] + [(c, f"seed's {pass_} knobs") for c in crossed]:
            if seed not in seen:
                seen.add(seed)
                ms = trial(seed, pass_, f"{pass_} [{label}]")
                if ms < best_ms[pass_]:
                    best, best_ms[pass_] = seed, ms
        values_of = lambda name: cls.__dataclass_fields__[name].metadata["search"]  # noqa: E731
        # each knob alone, then each kernel's tile and warps together (planner.Launch.TILES): a move of one
        # alone can leave a tile its warps do not hold
        moves = [(name,) for name in names] + list(cls.tiles(pass_))
        todo = sum(math.prod(len(values_of(n)) for n in move) for move in moves)
        for round_ in range(1, rounds + 1):
            improved, done = False, 0
            for move in moves:
                if time.monotonic() > deadline:
                    break
                # the move's values with the others at the best so far: they do not depend on
                # one another's times, so prepare() takes them all at once. A move started is
                # finished: its compilation (prepare) is most of its cost, and where that alone outlasts
                # the share (K = V = 256), stopping before its launches are timed would leave the
                # first knobs untried (gated_deltanet B2 T8192 K = V = 256: 32-token chunks, 2.5x the
                # forward's speed, never timed in a budget of 20 s; BENCHMARKS.md 2026-12-04, tenth run)
                candidates = [fit(dataclasses.replace(best, **dict(zip(move, values))))
                              for values in itertools.product(*map(values_of, move))]
                if prepare is not None:
                    new = list(dict.fromkeys(c for c in candidates if c not in seen))
                    if new:
                        prepare(new, pass_)
                label = "" if len(move) == 1 else ", " + "+".join(move)
                for candidate in candidates:
                    done += 1
                    if candidate in seen:
                        continue
                    seen.add(candidate)
                    ms = trial(candidate, pass_, f"{pass_} round {round_} [{done}/{todo}{label}]")
                    if ms < best_ms[pass_]:
                        best, best_ms[pass_], improved = candidate, ms, True
            if not improved or time.monotonic() > deadline:
                break
        if time.monotonic() > deadline:
            report(f"  {pass_}: its share of the budget of {budget_s:g} s is spent")
        report(f"  {pass_} best: {_changed(default, best)}: " +
               (f"{best_ms[pass_]:.3f} ms" if best_ms[pass_] < math.inf else "no launch ran"))
        best_of[pass_] = best
    last = passes[-1]
    for pass_ in passes[:-1]:
        if best_of[pass_] != best and best != default:
            # a later pass moved a knob this one times (the backward's value blocks): the time
            # recorded is the final launch's
            best_ms[pass_] = trial(best, pass_, f"{pass_} [final launch]")
    if best != default and best_ms[last] < math.inf:
        for pass_ in passes:
            if best_ms[pass_] < math.inf:
                times = {best: [best_ms[pass_]], default: [default_ms[pass_]]}
                for _ in range(CONFIRM):
                    for launch in (default, best):
                        times[launch].append(trial(launch, pass_, f"{pass_} [again]", again=True))
                best_ms[pass_], default_ms[pass_] = statistics.median(times[best]), statistics.median(times[default])
                report(f"  {pass_}: medians of {CONFIRM + 1} timings, the best {best_ms[pass_]:.3f} ms, "
                       f"the default {default_ms[pass_]:.3f} ms")
    if best != default and not stands(best_ms, default_ms, passes):
        # the last pass's time (forward + backward with a backward) decides, or a pass before it (the
        # forward alone: a prefill's) MIN_GAIN faster at no cost to the last: a forward's gain that costs
        # the training step more, or gains within the timing noise, do not stand
        before = (f", nor {MIN_GAIN:.0%} faster in {' or '.join(passes[:-1])} and as fast in {last}"
                  if passes[:-1] else "")
        report(f"  {last}: the best launch ({best_ms[last]:.3f} ms) is not {MIN_GAIN:.0%} faster than the "
               f"default ({default_ms[last]:.3f} ms){before}: the default stands")
        best, best_ms = default, dict(default_ms)
    finite = lambda d: {p: (ms if ms < math.inf else None) for p, ms in d.items()}  # noqa: E731
    return Found(best, tuple(trials), finite(default_ms), finite(best_ms))


def stands(best_ms: dict[str, float | None], default_ms: dict[str, float | None], passes: tuple[str, ...]) -> bool:
    """Whether a launch of these times replaces the default of those: MIN_GAIN faster in the last pass
    (forward + backward with a backward), or MIN_GAIN faster in a pass before it (the forward) and no
    slower in the last (softmax_causal B1 T32768 on an H100: forward 8.071 ms against the default's 8.472,
    forward + backward 37.093 against 37.672; BENCHMARKS.md 2026-12-06, seventh run)."""
    known = lambda p: best_ms.get(p) is not None and default_ms.get(p) is not None  # noqa: E731
    faster = lambda p: known(p) and best_ms[p] < (1 - MIN_GAIN) * default_ms[p]  # noqa: E731
    last = passes[-1]
    return faster(last) or (known(last) and best_ms[last] <= default_ms[last] and any(map(faster, passes[:-1])))


def _changed(default: planner.Launch, launch: planner.Launch) -> str:
    diff = [f"{f.name}={getattr(launch, f.name)}" for f in dataclasses.fields(launch)
            if getattr(launch, f.name) != getattr(default, f.name)]
    return " ".join(diff) or "default launch"


def do_bench(fn: Callable[[], object]) -> float:
    """The median time of fn in milliseconds (triton.testing.do_bench)."""
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def do_bench_graph(fn: Callable[[], object]) -> float:
    """The median time of fn in milliseconds, replayed from a CUDA graph (triton.testing.do_bench_cudagraph):
    a decode step's kernels without the host's launch cost, which at a few sequences outlasts them and
    hides a launch's difference in the noise (softmax_causal's B1 decode: the same launch at 0.084 and
    0.135 ms eager, BENCHMARKS.md); a serving step replays from a graph (attngen.serving). do_bench where
    fn cannot be captured."""
    import triton
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except RuntimeError:
        torch.cuda.synchronize()
        return do_bench(fn)


def tune(spec: Spec, shapes: list, dtype: torch.dtype, device: torch.device | str, *, mach: Machine | None = None,
         timer: Callable[[Callable[[], object]], float] | None = None, report: Callable[[str], None] = print,
         directory: Path | None = None, budget_s: float | None = None,
         seeds: tuple[dict[str, int], ...] = ()) -> list[Entry]:
    """Search the launch of a spec's kernels (with knobs) at each shape (testing.Shape) and write each
    shape's winner into the machine's table in `directory` (default: the user's) once its search
    ends, so that a later shape's failure (an illegal address ends the process's CUDA context) keeps
    the earlier ones. mach: the machine the table is for (default: the device's); timer(fn) ->
    milliseconds (default do_bench; do_bench_graph for a decode shape, fewer queries than keys);
    budget_s: seconds of search per shape (search()); seeds: knobs over each shape's default, launches
    the search times at its start beside the table's (`attngen tune --seed`)."""
    from . import runtime
    from .testing import LOWP_FACTOR, LOWP_FLOOR, bench_inputs, format_shape

    family = planner.launch_family(spec)
    if family is None:
        raise ValueError(f"spec {spec.name!r}: its kernels (recurrent, bidirectional) take no launch knobs to tune")
    if budget_s is not None and (isinstance(budget_s, bool) or not isinstance(budget_s, (int, float))
                                 or not 0 <= budget_s < math.inf):
        raise ValueError(f"budget_s: expected seconds, a finite number >= 0, or None; got {budget_s!r}")
    cls = planner.LAUNCHES[family]
    for knobs in seeds:
        bad = sorted(set(knobs) - set(cls.knobs()))
        if bad:
            raise ValueError(f"seeds: {', '.join(bad)} is no {cls.__name__} knob (spec {spec.name!r}); "
                             f"knobs: {', '.join(cls.knobs())}")
    mach = mach or machine(device)
    if mach is None:
        raise ValueError(f"device: tuning tables are per CUDA GPU; got {torch.device(device).type} tensors")
    op = runtime.load(spec)
    module = runtime.kernels_for(op)
    passes = ("fwd", "bwd") if ("chunked" if spec.is_linear else "parallel") in module.BACKWARD_FORMS else ("fwd",)
    entries = []
    for shape in shapes:
        start = time.time()
        inputs = bench_inputs(spec, shape, dtype, device)
        call = runtime.check_call(op, inputs)
        fit = functools.partial(planner.fit_launch, family, spec, call, dtype)
        default = fit(planner.default_launch(family, spec, call, dtype, multiprocessors(device)))
        # queries fewer than the keys (decode against a cache, ",Tq" shapes): the forward alone, as a
        # decode step runs it (the backward's knobs stay the default's), on a cache where the step's
        # cache would have the shape's keys as its rows (_cached_runner), timed from a CUDA graph
        decode = shape.k_len is not None and shape.q_len < shape.k_len
        run = (decode and _cached_runner(op, module, inputs, call)) or _runner(op, module, inputs, call)
        measure = _measurer(run, LOWP_FACTOR * LOWP_FLOOR[dtype], timer or (do_bench_graph if decode else do_bench))
        report(f"{spec.name} {format_shape(shape)} {dtype_name(dtype)} on {mach.describe()}:")
        prepare = (_compiler(module, run.args, run.backward_kw) if run.args and compiling.applies(torch.device(device))
                   else None)
        timed = ("fwd",) if decode else passes
        key_ = key(spec, family, call, dtype)
        given = tuple(dataclasses.replace(default, **knobs) for knobs in seeds)
        found = search(default, fit, measure, timed, report, budget_s=budget_s, prepare=prepare,
                       seeds=given + _seeds(directory or tune_dir(), mach, key_))
        entries.append(Entry(key_, spec.name, found.best, format_shape(shape),
                             _rounded(found.best_ms), _rounded(found.default_ms)))
        report(f"  {len(found.trials)} launches timed in {time.time() - start:.0f} s")
        path = record(entries[-1:], mach, directory)
        report(f"wrote {format_shape(shape)}'s entry to {path}")
    return entries


def tuned_shapes(spec: Spec, dtype: torch.dtype, mach: Machine, directory: Path | None = None) -> set[str]:
    """The shapes (B,T,H,K,V[,Tq]) the machine's table in `directory` (default: the user's) holds an
    entry of, tuned for this spec (its hash) and dtype: what `attngen tune --missing` skips."""
    path = (directory or tune_dir()) / mach.file_name()
    if not path.exists():
        return set()
    return {e.shape for e in read_table(path).entries if e.key.spec_hash == spec.hash and e.key.dtype == dtype_name(dtype)}


def _seeds(directory: Path, mach: Machine, key_: Key) -> tuple[planner.Launch, ...]:
    """The launches a search of key_'s shape starts beside the default, from the machine's table in
    `directory`: the entry it replaces, the nearest tuned bucket's launch, and a sibling GPU's shipped
    launch for the shape or its nearest (sibling_tables): those resolve() gives it without an entry; none
    from a table this version cannot read (record() then says so)."""
    path = directory / mach.file_name()
    try:
        entries = read_table(path).entries if path.exists() else ()
    except (ValueError, TypeError, OSError):
        return ()
    by_key = {e.key: e.launch for e in entries}
    near = nearest(key_, by_key)
    siblings = sibling_tables(mach)
    sibling = key_ if key_ in siblings else nearest(key_, siblings)
    return (((by_key[key_],) if key_ in by_key else ()) + ((by_key[near],) if near else ())
            + ((siblings[sibling][0].launch,) if sibling else ()))


def _rounded(times: dict[str, float | None]) -> dict[str, float | None]:
    return {p: None if ms is None else round(ms, 4) for p, ms in times.items()}


def _measurer(run, tol: float, timer) -> Callable[[planner.Launch, str], float]:
    """measure(launch, pass) for search(): the pass's outputs checked against those of the first
    launch that ran in the pass (search() times the default first), then timed. The same kernels
    tiled otherwise differ by rounding (tol: relative); a miscompiled launch does not."""
    ref: dict[str, list] = {}

    def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
        # on the tensors' device (testing.rel_error copies both to the host in float64: once per
        # launch for every gradient at the benchmark shape); inf where a has a NaN or inf
        a, b = a.detach().float(), b.detach().float()
        if not bool(torch.isfinite(a).all()):
            return math.inf
        return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))

    def measure(launch: planner.Launch, pass_: str) -> float:
        got = run(launch, pass_)
        worst = max(rel_error(a, b) for a, b in zip(got, ref.setdefault(pass_, got)))
        if not worst <= tol:
            raise ValueError(f"outputs differ from the default launch's by {worst:.1e} (allowed {tol:.1e})")
        return timer(lambda: run.step(launch, pass_))
    return measure


def _compiler(module, args: Callable[[planner.Launch], tuple],
              backward_kw: dict) -> Callable[[list[planner.Launch], str], None]:
    """prepare(launches, pass) for search(): the kernels of the launches' pass (fwd: the forward's;
    bwd: the forward's and the backward's, called with backward_kw as the timing calls it) compiled
    side by side on the compilation pool, so that timing them compiles nothing. A launch whose
    kernels fail to compile is left to the timing, which reports it."""
    def prepare(launches: list[planner.Launch], pass_: str) -> None:
        with compiling.compile_only(compiling.threads(), ignore_errors=True):
            for launch in launches:
                try:
                    compiling.dry_run(module, args(launch), backward=pass_ == "bwd", **backward_kw)
                except Exception:  # noqa: BLE001 -- the launch's own timing reports its error
                    pass
    return prepare


def _cached_runner(op, module, inputs: dict, call: Call):
    """run(launch, "fwd") -> [o] for a softmax decode shape through the serving call (module.cached_op):
    the kernels a decode step runs (the append of the new keys and values, the split forward on the
    cache's rows, read by pointers, and the merge), on a cache of Tk rows per sequence (the bucket
    runtime.cache_launch looks up for such a cache) holding the first Tk - Tq keys before each call (the
    call appends the last Tq; the cache's log decays, with scalar decay, zero). None where a serving
    cache of that shape has other rows (a sliding window's ring) or the spec is linear."""
    from .serving import StateCache, cached_softmax_args
    spec = op.spec
    if spec.is_linear or spec.mask == "sliding_window" or not hasattr(module, "cached_op"):
        return None
    q, k, v, g = (inputs.get(n) for n in ("q", "k", "v", "g"))
    B, Tq, H = q.shape[:3]
    Tk, HK = k.shape[1], k.shape[2]
    cache = StateCache(op, B, HK, k.shape[3], v.shape[3], device=q.device, dtype=q.dtype, max_len=Tk,
                       query_heads=H if spec.decay == "scalar" else None)
    held = Tk - Tq
    cache.k[:, :held], cache.v[:, :held] = k[:, :held], v[:, :held]
    new = [None if t is None else t[:, held:].contiguous() for t in (k, v, g)]
    slots = torch.arange(B, dtype=torch.int32, device=q.device)

    def forward(launch):
        cache.lengths.fill_(held)
        return module.cached_op(*cached_softmax_args(spec, cache, q, *new, slots, None, call.scale, Tq,
                                                      launch.ints()))

    def run(launch, pass_):
        return [forward(launch)]

    run.args, run.step = None, lambda launch, pass_: forward(launch)
    return run


def _runner(op, module, inputs: dict, call: Call) -> Callable[[planner.Launch, str], list]:
    """run(launch, pass) -> the tensors a pass computes, through the generated module's op: fwd the
    outputs; bwd the gradients from the forward's outputs (computed once per launch)."""
    spec = op.spec
    q, k, v, g, beta = (inputs.get(n) for n in ("q", "k", "v", "g", "beta"))
    # the output's gradient, [B, Tq, H, V]
    do = torch.randn(q.shape[:3] + v.shape[3:], device=q.device,
                     generator=torch.Generator(device=q.device).manual_seed(1)).to(v.dtype)
    outputs: dict = {}

    if spec.is_linear:
        omega = op.features(call.head_dim, q.device, torch.float32)

        def args(launch):
            return LINEAR_OP.bind(q=q, k=k, v=v, g=g, beta=beta, omega=omega, initial_state=None, cu_seqlens=None,
                                  scale=call.scale, form="chunked", launch=launch.ints(), output_final_state=False,
                                  for_backward=True)
    else:
        def args(launch):
            return SOFTMAX_OP.bind(q=q, k=k, v=v, g=g, cu_seqlens=None, scale=call.scale, max_len=call.max_len,
                                   launch=launch.ints())

    def forward(launch):
        return module.op(*args(launch))

    # as autograd calls it: a linear backward without the decay gradient where g requires no grad
    backward_kw = dict(decay_grad=g is not None and g.requires_grad) if spec.is_linear else {}

    def backward(launch, *outputs):
        # the generated backward(op's arguments, its outputs, their gradients: do and none for the other)
        return module.backward(*args(launch), *outputs, do, None, **backward_kw)

    def run(launch, pass_):
        if pass_ == "fwd":
            return [forward(launch)[0]]
        if launch not in outputs:
            outputs.clear()
            outputs[launch] = forward(launch)
        return [gr for gr in backward(launch, *outputs[launch]) if gr is not None]

    def step(launch, pass_):
        # what one timed repetition runs: fwd the forward; bwd the forward and the backward (a
        # training step: the forward knobs the backward takes change both)
        outs = forward(launch)
        if pass_ == "bwd":
            backward(launch, *outs)

    run.args, run.step, run.backward_kw = args, step, backward_kw
    return run
