"""torch.compile(fullgraph=True) traces every shipped spec's op without a graph break on the
PyTorch forms (the default CPU path), forward and backward, and does not recompile when called
again with the same shapes (issue: 'Inline attempt with __self__' from the plan's networkx graph,
sympy run inside the call)."""
from __future__ import annotations

import pytest
import torch

import attngen
from attngen.testing import Shape, random_inputs

from specs import shipped, stem

SPECS = shipped()


@pytest.mark.parametrize("path", SPECS, ids=stem)
def test_fullgraph_on_the_pytorch_forms(path, monkeypatch):
    monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
    torch._dynamo.reset()  # every spec's step is the same code object: start its cache afresh
    op = attngen.load(path)
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=20, heads=2, head_dim=8, value_dim=8),
                           dtype=torch.float32)
    inputs = {n: (t.float() if t.is_floating_point() else t) for n, t in inputs.items()}
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(**kw):
        out = op(**kw)
        return out[0] if isinstance(out, tuple) else out

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    eager = step(**inputs)
    for _ in range(2):
        leaves = {n: t.detach().requires_grad_(True) if t.is_floating_point() else t for n, t in inputs.items()}
        o = compiled(**leaves)
        o.sum().backward()
        assert torch.allclose(o, eager, rtol=1e-5, atol=1e-6)
        assert all(t.grad is not None and torch.isfinite(t.grad).all()
                   for t in leaves.values() if isinstance(t, torch.Tensor) and t.requires_grad)
    assert len(graphs) == 1, f"{len(graphs)} graphs for two calls of the same shapes"


SOFTMAX_SPECS = shipped("softmax")


@pytest.mark.parametrize("path", SOFTMAX_SPECS, ids=stem)
def test_fullgraph_return_lse(path, monkeypatch):
    """return_lse traces too, on the PyTorch forms (the kernels': test_kernels_softmax_bwd.py), with
    a loss on o and on the lse; one graph for two calls."""
    monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
    torch._dynamo.reset()
    op = attngen.load(path)
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=20, k_len=29, heads=2, head_dim=8, value_dim=8),
                           dtype=torch.float32)
    inputs = {n: (t.float() if t.is_floating_point() else t) for n, t in inputs.items()}
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(**kw):
        o, lse = op(**kw, return_lse=True)
        return o.sum() + lse.sum()

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    eager_leaves = {n: t.detach().requires_grad_(True) for n, t in inputs.items()}
    step(**eager_leaves).backward()
    for _ in range(2):
        leaves = {n: t.detach().requires_grad_(True) for n, t in inputs.items()}
        compiled(**leaves).backward()
        for n, t in leaves.items():
            assert torch.allclose(t.grad, eager_leaves[n].grad, rtol=1e-5, atol=1e-6), n
    assert len(graphs) == 1, f"{len(graphs)} graphs for two calls of the same shapes"


def test_launch_lookup_is_marked_constant_as_the_decorator_marks():
    """The launch lookup carries the mark torch.compiler.assume_constant_result sets (tuning.py sets
    it without the decorator, which imports torch._dynamo at attngen's import); a torch whose
    decorator marks otherwise fails here, not silently in a traced call."""
    from attngen import tuning

    def probe():
        return 0
    marked = torch.compiler.assume_constant_result(probe)
    assert marked is probe and getattr(probe, tuning.DYNAMO_CONSTANT) is True
    assert getattr(tuning._launch_ints, tuning.DYNAMO_CONSTANT) is True


def test_load_does_not_import_dynamo_or_sympy():
    """attngen.load in a fresh process leaves torch._dynamo unimported (a second of its time), and
    sympy too for a spec without a feature map (only the feature maps' printing needs it: 0.74 -> 0.37 s
    of gated_deltanet's load on the CPU machine)."""
    import subprocess
    import sys
    from pathlib import Path
    code = ("import sys, attngen; attngen.load(sys.argv[1]); "
            "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)")
    spec = Path(__file__).resolve().parents[1] / "specs" / "gated_deltanet.yaml"
    out = subprocess.run([sys.executable, "-c", code, str(spec)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"
