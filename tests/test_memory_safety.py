"""Memory safety and lifetimes: a strided cu_seqlens, generated modules imported once per
process whatever the number of specs or threads, the cache directory's files, launch grids
within CUDA's limits."""
from __future__ import annotations

import builtins
import errno
import io
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import attngen
from attngen import codegen
from attngen.testing import Shape, kernel_launch, outputs_and_grads, random_inputs

from specs import SHIPPED, shipped, stem

PACKED = Shape(batch=1, q_len=12, heads=2, head_dim=4, value_dim=5, cu_seqlens=(0, 5, 6, 12))


# --------------------------------------------------------------------------- strided cu_seqlens

def strided(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """cu_seqlens as every other element of a tensor twice as long whose gaps repeat the offsets
    ([0, 0, 5, 5, ...]): read as if contiguous it is another packing, still within the tokens
    (large values in the gaps would make the unfixed kernels write out of bounds)."""
    view = cu_seqlens.repeat_interleave(2)[::2]
    assert not view.is_contiguous() and torch.equal(view, cu_seqlens)
    return view


STRIDED = [("gated_deltanet", "recurrent"), ("gated_deltanet", "chunked"), ("gla", "chunked"),
           ("linear_bidirectional", "parallel"), ("softmax_causal", None), ("forgetting_attention", None)]


@pytest.mark.parametrize("name, form", STRIDED, ids=[f"{n}-{f}" for n, f in STRIDED])
def test_strided_cu_seqlens_equals_its_contiguous_copy(backend, name, form):
    """Outputs, final states and gradients of every input, bit for bit."""
    op = attngen.load(SHIPPED[name])
    dtype = torch.float32 if backend == "triton" else torch.float64
    inputs = random_inputs(op.spec, PACKED, dtype=dtype)
    if not op.spec.is_linear:
        inputs.pop("initial_state", None)
    fn = (lambda **kw: op(**kw, form=form)) if form else op
    want = outputs_and_grads(fn, op.spec, inputs, with_grads=True)
    got = outputs_and_grads(fn, op.spec, {**inputs, "cu_seqlens": strided(inputs["cu_seqlens"])}, with_grads=True)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs with a strided cu_seqlens"


# The chunk the generated op runs STRIDED's chunked form at.
CHUNKS = {"chunked": 16}


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("name, form", STRIDED, ids=[f"{n}-{f}" for n, f in STRIDED])
def test_generated_entry_points_take_a_strided_cu_seqlens(name, form):
    """The generated module called directly (its op and backward), not through attngen.load."""
    spec = attngen.load_spec(SHIPPED[name])
    module = codegen.load_module(spec)
    inputs = random_inputs(spec, PACKED, dtype=torch.float32, initial_state=False)
    q, k, v, g, beta = inputs["q"], inputs["k"], inputs["v"], inputs.get("g"), inputs.get("beta")
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(1)).to(v)

    kernel_form, launch = kernel_launch(attngen.load(spec), inputs, form, CHUNKS.get(form))

    def run(cu_seqlens):
        if not spec.is_linear:
            o, lse = module.op(q, k, v, g, cu_seqlens, 0.5, 6, launch)
            return (o, lse, *module.backward(q, k, v, g, cu_seqlens, 0.5, 6, launch, o, lse, do, None)[:4])
        args = (q, k, v, g, beta, None, None, cu_seqlens, 0.5, kernel_form, launch)
        o, ht, saved, starts = module.op(*args, True, True)
        if form not in module.BACKWARD_FORMS:
            return o, ht
        grads = module.backward(*args, True, True, o, ht, saved, starts, do, torch.ones_like(ht))
        return (o, ht, *(gr for gr in grads if gr is not None))

    cu = inputs["cu_seqlens"]
    want, got = run(cu), run(strided(cu))
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got)):
        if a is not None:
            assert torch.equal(a, b), f"result {i} differs with a strided cu_seqlens"


# --------------------------------------------------------------------------- module lifetimes

ROOT = Path(__file__).resolve().parent.parent

# Past 128 distinct specs the loader once dropped the oldest module and imported it again on the
# next load, registering its op over the live one: the first op then crashed (SIGSEGV).
MANY_SPECS = '''
import sys, torch, attngen
spec = lambda i: {"name": f"e{i}", "attention": "linear", "feature_map": {"expr": f"x*x + {i}"}, "decay": "scalar"}
first = attngen.load(spec(0))
for i in range(1, int(sys.argv[1])):
    attngen.load(spec(i))
again = attngen.load(spec(0))
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 3, 2, 4, generator=gen) for _ in range(3))
g = -torch.rand(1, 3, 2, generator=gen)
o, _ = first(q, k, v, g)
assert torch.equal(again(q, k, v, g)[0], o)
print("ok")
'''


def test_op_survives_many_specs_and_a_reload(backend, tmp_path):
    env = {**os.environ, "ATTNGEN_CACHE": str(tmp_path), "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", MANY_SPECS, "131"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", \
        f"exit status {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"


@pytest.mark.usefixtures("triton_backend")
def test_threads_loading_one_new_spec():
    """Four threads load one spec no thread has loaded yet, at once."""
    spec = {"name": "threads", "attention": "linear", "feature_map": {"expr": "x*x + 3"}, "decay": "scalar"}
    barrier, errors, ops = threading.Barrier(4), [], []

    def load():
        barrier.wait()
        try:
            ops.append(attngen.load(spec))
        except Exception as exc:  # noqa: BLE001 - every thread's failure is the finding
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len({id(op._kernels) for op in ops}) == 1
    inputs = random_inputs(ops[0].spec, Shape(1, 3, 2, 4, 4), dtype=torch.float32)
    want = ops[0](**inputs)[0]
    for op in ops[1:]:
        assert torch.equal(op(**inputs)[0], want)


# --------------------------------------------------------------------------- the cache directory

def new_spec(name: str):
    """A spec no other test loads (its module is imported once per process)."""
    return attngen.load_spec({"name": name, "attention": "linear", "feature_map": {"expr": "x*x + 5"},
                              "decay": "scalar"})


def test_cache_file_that_is_not_utf8_is_rewritten(tmp_path, monkeypatch):
    """A cache file and a committed module that are not UTF-8 (a disk error, a stray write)."""
    spec = new_spec("not_utf8")
    garbage = b"\xff\xfe\xfa not a module \x80\n"
    monkeypatch.setenv("ATTNGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(codegen, "REPO_GENERATED", tmp_path / "generated")
    cached = tmp_path / "cache" / spec.hash / codegen.cache_key(codegen.render(spec).encode()) / "not_utf8.py"
    for path in (cached, tmp_path / "generated" / "not_utf8.py"):
        path.parent.mkdir(parents=True)
        path.write_bytes(garbage)
    module = codegen.load_module(spec)
    assert module.SPEC_HASH == spec.hash
    assert cached.read_bytes() == codegen.render(spec).encode()


def test_two_renderings_of_a_spec_keep_their_own_cache_files(tmp_path, monkeypatch):
    """Two attngen versions sharing one cache directory (two environments at once) render one spec to
    different bytes: each rendering has a file of its own, so one process cannot overwrite the other's
    module between that one's write and its import (a process of each ran the same hypothesis specs at
    once and one imported the other's kernels, whose signature it did not call)."""
    spec = new_spec("two_versions")
    monkeypatch.setenv("ATTNGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(codegen, "REPO_GENERATED", tmp_path / "generated")
    ours = codegen._module_path(spec)
    render = codegen.render
    monkeypatch.setattr(codegen, "render", lambda s: render(s) + "# another attngen version's rendering\n")
    theirs = codegen._module_path(spec)
    assert ours != theirs and ours.parent.parent == theirs.parent.parent == tmp_path / "cache" / spec.hash
    assert ours.read_bytes() == render(spec).encode()
    assert theirs.read_bytes() == codegen.render(spec).encode()


def unwritable_under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "cache"


def unwritable_read_only(tmp_path: Path) -> Path:
    directory = tmp_path / "read_only"
    directory.mkdir(mode=0o555)
    if os.access(directory, os.W_OK):
        pytest.skip("this user writes to read-only directories (root)")
    return directory


@pytest.mark.parametrize("make", [unwritable_under_a_file, unwritable_read_only], ids=["under_a_file", "read_only"])
def test_unwritable_cache_falls_back_with_one_warning(tmp_path, monkeypatch, make):
    directory = make(tmp_path)
    monkeypatch.setenv("ATTNGEN_CACHE", str(directory))
    with pytest.warns(UserWarning) as record:
        module = codegen.load_module(new_spec(f"unwritable_{make.__name__}"))
    messages = [str(w.message) for w in record]
    assert len(messages) == 1 and str(directory) in messages[0] and "ATTNGEN_CACHE" in messages[0], messages
    assert module.SPEC_HASH == new_spec(f"unwritable_{make.__name__}").hash
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        codegen.load_module(new_spec(f"unwritable_{make.__name__}_again"))


def test_cache_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A write that fails part way (a full disk) leaves the file as it was and no other file."""
    spec = new_spec("written_whole")
    path = tmp_path / f"{spec.name}.py"
    path.write_bytes(b"# an older rendering\n")
    real_open = io.open

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def full_disk_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        writes = isinstance(file, (str, os.PathLike)) and Path(file).parent == tmp_path and set(mode) & set("wxa+")
        return FullDisk(f) if writes else f

    monkeypatch.setattr(io, "open", full_disk_open)
    monkeypatch.setattr(builtins, "open", full_disk_open)
    with pytest.raises(OSError, match="No space left"):
        codegen.compile_to(spec, tmp_path)
    monkeypatch.undo()
    assert path.read_bytes() == b"# an older rendering\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    codegen.compile_to(spec, tmp_path)
    assert path.read_bytes() == codegen.render(spec).encode()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


# --------------------------------------------------------------------------- launch grids

# CUDA caps grid dimensions 1 and 2 at 65,535 blocks and dimension 0 at 2**31 - 1, so the launches
# put the sequences x heads product (2048 x 32 in a decode step, say) on dimension 0. The test
# caps the interpreter's dimensions 1 and 2 below N x H = 4 and above what else a small call
# launches (H = 2 heads, one value block, one query block).
GRID_CAP = 3
GRID_SHAPE = Shape(batch=2, q_len=4, heads=2, head_dim=4, value_dim=4)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("path", shipped(), ids=stem)
def test_launch_grids_put_sequences_times_heads_on_dimension_0(path, monkeypatch):
    from triton.runtime import interpreter

    builder, launches = interpreter.interpreter_builder, []
    real_set_grid_dim = builder.set_grid_dim

    def set_grid_dim(nx, ny, nz):
        launches.append((nx, ny, nz))
        if max(ny, nz) > GRID_CAP:
            raise ValueError(f"grid ({nx}, {ny}, {nz}): dimensions 1 and 2 over the cap {GRID_CAP}")
        real_set_grid_dim(nx, ny, nz)

    monkeypatch.setattr(builder, "set_grid_dim", set_grid_dim)
    op = attngen.load(path)
    inputs = random_inputs(op.spec, GRID_SHAPE, dtype=torch.float32, initial_state=False)
    forms = [f.name for f in op.plan.forms if f.name != "parallel" or op.spec.mask == "bidirectional"]
    for form in forms if op.spec.is_linear else [None]:
        chunk = 16 if form == "chunked" else None
        fn = (lambda **kw: op(**kw, form=form, chunk_size=chunk)) if form else op  # noqa: B023
        outputs_and_grads(fn, op.spec, inputs, with_grads=True)
    assert launches and max(nx for nx, _, _ in launches) >= GRID_SHAPE.batch * GRID_SHAPE.heads
