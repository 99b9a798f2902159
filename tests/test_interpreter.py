"""The CPU suite's time: Triton's interpreter walks triton.language's modules once per kernel launch,
not at every call of a @triton.jit helper inside it (tests/conftest.py); the walks were about half
of the kernel tests' time. A Triton whose interpreter the conftest no longer fits fails here, not
by a slower suite."""
from __future__ import annotations

import os

import pytest
import torch

import attngen
from attngen.testing import Shape, random_inputs

import specs

pytestmark = [pytest.mark.usefixtures("triton_backend"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only")]


def test_the_interpreter_walks_the_language_once_per_launch(monkeypatch):
    from triton.runtime import interpreter

    walks, launches, helper_calls = [], [], []
    walk, launch = interpreter._patch_builtin, interpreter.GridExecutor.__call__
    helper = interpreter.InterpretedFunction.__call__

    def counted(calls, fn):
        def wrapper(*args, **kwargs):
            calls.append(1)
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(interpreter, "_patch_builtin", counted(walks, walk))
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted(launches, launch))
    monkeypatch.setattr(interpreter.InterpretedFunction, "__call__", counted(helper_calls, helper))
    op = attngen.load(specs.SHIPPED["gated_deltanet"])
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=40, heads=1, head_dim=8, value_dim=8), seed=0)
    inputs = {n: (t.float() if t.is_floating_point() else t) for n, t in inputs.items()}
    o, _ = op(**inputs, output_final_state=True, form="chunked", chunk_size=16)
    assert torch.isfinite(o).all()
    # the kernels' helpers (chunked_dot, tl.sum, ...) run in their loops: many calls per launch
    assert launches and len(helper_calls) >= 10 * len(launches), (len(launches), len(helper_calls))
    # at most two patches of the language per launch: the launch's own, and that of its first helper
    # naming a module the launch's kernel does not (tl.core; a helper's patches are never restored, so
    # they hold to the launch's end). Each walks at most tl, tl.tensor, tl.math, tl.core, tl.core.tensor
    # and the tensor descriptors: 12 walks per launch at most (27 to 30 for these 3 launches; a patch at
    # every helper call walks some 350 per launch)
    assert len(walks) <= 12 * len(launches), (len(walks), len(launches), len(helper_calls))
