"""A generated module used on its own: imported without attngen.load (loading of attngen only its
kernel library, attngen.kernel_lib, and with torch imported first attngen.compiling's warm start) it registers its ops and autograd (torch.ops.attngen.<spec
name>, keyword arguments as in the runtime contract); the loader says when a committed module
differs from a fresh rendering."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from attngen import codegen, load_spec

ROOT = Path(__file__).resolve().parent.parent

# Imported the importlib way (sys.modules set before exec_module), called through torch.ops with
# keywords and differentiated before attngen is imported; then compared with attngen.load's op.
ALONE = '''
import importlib.util, sys, torch
name = sys.argv[1]
module_spec = importlib.util.spec_from_file_location(f"gen_{name}", f"generated/{name}.py")
module = importlib.util.module_from_spec(module_spec)
sys.modules[module_spec.name] = module
module_spec.loader.exec_module(module)
# of attngen only its kernel library (and the package's constants) is loaded: none of the compiler. With
# torch imported first, the package also loads attngen.compiling (torch only), whose warm_key starts
# Triton's hash of its library where a GPU driver is present
loaded = sorted(m for m in sys.modules if m == "attngen" or m.startswith("attngen."))
assert set(loaded) <= {"attngen", "attngen.spec", "attngen.kernel_lib", "attngen.compiling"}, \
    f"importing the module imported {loaded}"
assert module.SPEC_NAME == name and len(module.SPEC_HASH) == 16

gen = torch.Generator().manual_seed(0)
linear = module.SPEC["attention"] == "linear"
q, k, v = (torch.randn(1, 7, 2, 4, generator=gen) for _ in range(3))
kw = dict(cu_seqlens=torch.tensor([0, 3, 7]))
if module.SPEC["decay"] != "none":
    kw["g"] = -torch.rand(1, 7, 2, generator=gen)
if linear:
    kw["output_final_state"] = True


def run(fn, lse=False):
    """Outputs and gradients of a loss on them (softmax with lse: o and its log-sum-exp)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    args = {n: t.clone().requires_grad_() if n == "g" else t for n, t in kw.items()}
    out = fn(*leaves, **args, **({"return_lse": True} if lse else {}))
    o, ht = out if linear or lse else (out, None)
    loss = o.square().sum() + (ht.square().sum() if ht is not None else 0)
    grads = torch.autograd.grad(loss, leaves + ([args["g"]] if "g" in args else []))
    return [o] + ([ht] if ht is not None else []) + list(grads)


def runs(fn):
    return run(fn) + ([] if linear else run(fn, lse=True))


by_name = runs(getattr(torch.ops.attngen, name))
by_entry = runs(module.attention)
import attngen
op = attngen.load(f"specs/{name}.yaml")
by_load = runs(op)
assert attngen.runtime.kernels_for(op) is module, "attngen.load imported the module a second time"
for i, (a, b, c) in enumerate(zip(by_name, by_entry, by_load)):
    assert torch.equal(a, c) and torch.equal(b, c), f"result {i} differs from attngen.load's op"
print("ok")
'''


@pytest.mark.parametrize("name", ["mamba2", "linear_bidirectional", "softmax_causal"])
def test_generated_module_imported_alone(name, tmp_path):
    """mamba2 differentiates through its backward kernels, linear_bidirectional through the
    runtime's recompute (no backward kernel for its form), softmax_causal through its own, with
    and without return_lse (torch.ops.attngen.softmax_causal's overload .lse)."""
    env = {**os.environ, "ATTNGEN_BACKEND": "triton", "TRITON_INTERPRET": "1", "ATTNGEN_CACHE": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", ALONE, name], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", \
        f"exit status {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


def test_hand_edited_committed_module_is_named_once(tmp_path, monkeypatch):
    committed = tmp_path / "generated"
    shutil.copytree(ROOT / "generated", committed)
    monkeypatch.setattr(codegen, "REPO_GENERATED", committed)
    monkeypatch.setenv("ATTNGEN_CACHE", str(tmp_path / "cache"))
    spec = load_spec(ROOT / "specs" / "mamba2.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert codegen._module_path(spec) == committed / "mamba2.py"
    with (committed / "mamba2.py").open("a") as f:
        f.write("print('debugging')\n")
    with pytest.warns(UserWarning) as record:
        path = codegen._module_path(spec)
    assert path == tmp_path / "cache" / spec.hash / codegen.cache_key(codegen.render(spec).encode()) / "mamba2.py"
    assert len(record) == 1 and str(committed / "mamba2.py") in str(record[0].message) \
        and str(path) in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert codegen._module_path(spec) == path
        # another spec of that name is no edit of the committed module
        other = load_spec({**spec.to_dict(), "decay": "none"})
        codegen._module_path(other)


@pytest.mark.usefixtures("triton_backend")
def test_two_specs_of_one_name():
    """The first holds torch.ops.attngen.<name>; the second keeps its hashed op and says so."""
    import torch

    first = load_spec({"name": "twin", "attention": "linear", "feature_map": {"expr": "x*x + 1"}})
    second = load_spec({"name": "twin", "attention": "linear", "feature_map": {"expr": "x*x + 2"}})
    codegen.load_module(first)
    with pytest.warns(UserWarning, match=f"spec hash {first.hash}.*hash {second.hash}"):
        module = codegen.load_module(second)
    assert module.CONTRACT_LIBRARY is None
    q = torch.ones(1, 2, 1, 4)
    o, _ = torch.ops.attngen.twin(q, q, q)
    assert torch.equal(o, codegen.load_module(first).attention(q, q, q)[0])
    assert not torch.equal(o, module.attention(q, q, q)[0])
