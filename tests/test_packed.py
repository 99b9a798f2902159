"""Packed sequences (cu_seqlens) are independent (DESIGN.md §3): a NaN or inf in one sequence's
input must leave every other sequence's outputs, final states and gradients untouched, bit for
bit, on every backend; and the PyTorch forms' cost must follow the tokens of a pack, not its
number of sequences times the longest.

Bit for bit means against the same pack with clean inputs. Separate calls are no such yardstick:
a pack pads its sequences to a common length and batches them, which changes the shapes of the
matrix products and so their rounding (tests/test_metamorphic.py holds packs to separate calls
at float64 rounding).
"""
from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attngen
from attngen.testing import Shape, outputs_and_grads, random_inputs

from specs import SHIPPED, shipped, stem

# Lengths that differ: a padded slot of a short sequence lies over the next sequence's tokens.
# The first four share a padding group of the PyTorch forms (planner.packed_groups), the last
# is in a group of its own.
CU_SEQLENS = (0, 17, 47, 68, 93, 133)
POISONED = 1        # the sequence that gets the bad value
TOKEN = 5           # at this token of it
BAD = (float("nan"), float("inf"), float("-inf"))


def poisonable(spec) -> list[str]:
    """The inputs that hold values of single sequences (a constant decay's g is per head)."""
    names = ["q", "k", "v"]
    if spec.decay in ("scalar", "vector"):
        names.append("g")
    if spec.is_linear and spec.update == "delta":
        names.append("beta")
    if spec.is_linear:
        names.append("initial_state")
    return names


def poison(inputs: dict, name: str, value: float) -> dict:
    t = inputs[name].clone()
    if name == "initial_state":
        t[POISONED, 0, 0, 0] = value
    else:
        t[0, int(inputs["cu_seqlens"][POISONED]) + TOKEN, 0] = value
    return dict(inputs, **{name: t})


def others(key: str, t: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """The part of an output or gradient that belongs to the sequences other than POISONED."""
    if key in ("final_state", "dinitial_state"):
        return torch.cat([t[:POISONED], t[POISONED + 1:]])
    start, end = int(cu[POISONED]), int(cu[POISONED + 1])
    return torch.cat([t[:, :start], t[:, end:]], 1)


def damaged(op, inputs: dict, variants, names, bad, with_grads: bool) -> list[str]:
    """Every (form, input, bad value) whose poisoned run differs from the clean run anywhere
    outside the poisoned sequence."""
    failures = []
    for form, chunk in variants:
        run = lambda **kw: op(**kw, form=form, chunk_size=chunk)
        clean = outputs_and_grads(run, op.spec, inputs, with_grads)
        for name in names:
            for value in bad:
                got = outputs_and_grads(run, op.spec, poison(inputs, name, value), with_grads)
                for key, want in clean.items():
                    if key == "dg" and op.spec.decay == "constant":
                        continue  # one g per head, shared by every sequence
                    if not torch.equal(others(key, got[key], inputs["cu_seqlens"]),
                                       others(key, want, inputs["cu_seqlens"])):
                        failures.append(f"{form}: {value} in {name} changes other sequences' {key}")
    return failures


def packed_inputs(op, cu_seqlens: tuple[int, ...]) -> dict:
    shape = Shape(batch=1, q_len=cu_seqlens[-1], heads=2, head_dim=4, value_dim=3, cu_seqlens=cu_seqlens)
    return random_inputs(op.spec, shape, seed=3, initial_state=op.spec.is_linear)


@pytest.mark.parametrize("path", shipped(), ids=stem)
def test_bad_value_stays_in_its_sequence_torch(path, monkeypatch):
    """The PyTorch forms: every shipped spec, form and per-sequence input, NaN and +-inf;
    outputs, final states and gradients."""
    monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
    op = attngen.load(path)
    variants = [(f.name, 16 if f.name == "chunked" else None) for f in op.plan.forms]
    failures = damaged(op, packed_inputs(op, CU_SEQLENS), variants, poisonable(op.spec), BAD, with_grads=True)
    assert not failures, "\n".join(failures)


# The kernels through Triton's interpreter (slow): one spec per kernel family (recurrent, chunked
# with scalar and vector decay, bidirectional, softmax with the decay bias), the inputs that reach
# the most state, gradients where they run cheaply, a shorter pack.
KERNEL_CU_SEQLENS = (0, 9, 30, 41, 50)
KERNEL_CASES = [
    ("gated_deltanet", ("recurrent", None), ["g", "v"], False),
    ("gated_deltanet", ("chunked", 16), ["g"], True),
    ("gla", ("chunked", 16), ["g"], False),
    ("linear_bidirectional", ("parallel", None), ["k"], True),
    ("forgetting_attention", ("parallel", None), ["g", "k"], True),
]


@pytest.mark.parametrize("name,variant,names,with_grads", KERNEL_CASES,
                         ids=[f"{c[0]}-{c[1][0]}" for c in KERNEL_CASES])
def test_bad_value_stays_in_its_sequence_kernels(name, variant, names, with_grads, triton_backend):
    op = attngen.load(SHIPPED[name])
    failures = damaged(op, packed_inputs(op, KERNEL_CU_SEQLENS), [variant], names, BAD[:2], with_grads)
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- cost of the PyTorch forms

class ElementCount(TorchDispatchMode):
    """Counts the elements of every tensor the ops under it compute (views excluded): `total`,
    a measure of the work, and `largest`, of the memory one step needs."""

    def __init__(self):
        super().__init__()
        self.total = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.total += t.numel()
                    self.largest = max(self.largest, t.numel())
        return out


def count(op, inputs: dict, **kw) -> ElementCount:
    with torch.no_grad(), ElementCount() as counted:
        op(**inputs, **kw)
    return counted


@pytest.mark.parametrize("name", ["softmax_causal", "forgetting_attention", "sliding_window", "softmax_bidirectional"])
def test_softmax_form_is_quadratic(name, monkeypatch):
    """The softmax form takes O(T^2) work and O(T * block) memory: query blocks of 16 here, so
    that T = 256 already has many; no step may build a [T, T] tensor, and doubling T may at most
    quadruple the work."""
    monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
    monkeypatch.setattr(attngen.forms, "SOFTMAX_QUERY_BLOCK", 16)
    op = attngen.load(SHIPPED[name])
    counts = {}
    for T in (128, 256):
        inputs = random_inputs(op.spec, Shape(batch=1, q_len=T, heads=1, head_dim=4, value_dim=4), dtype=torch.float32)
        counts[T] = count(op, inputs)
        assert counts[T].largest <= 16 * T, f"T = {T}: a step computes {counts[T].largest} elements at once"
    assert counts[256].total <= 4.5 * counts[128].total, \
        f"work {counts[128].total} at T = 128, {counts[256].total} at T = 256"


PACK_FORMS = [("gla", "recurrent", None), ("gla", "parallel", None), ("gla", "chunked", 16),
              ("gated_deltanet", "chunked", 16), ("softmax_causal", "parallel", None)]


@pytest.mark.parametrize("name,form,chunk", PACK_FORMS, ids=[f"{n}-{f}" for n, f, _ in PACK_FORMS])
def test_packed_cost_follows_tokens(name, form, chunk, monkeypatch):
    """One long sequence and many short ones cost about what their separate calls cost (padding
    within a group of sequences at most doubles its tokens; the packing adds a few gathers), not
    the number of sequences times the longest (10 to 40 times as much here)."""
    monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
    op = attngen.load(SHIPPED[name])
    lengths = [200] + [1, 2, 3, 5] * 10
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    shape = Shape(batch=1, q_len=cu[-1], heads=1, head_dim=8, value_dim=8, cu_seqlens=tuple(cu))
    inputs = random_inputs(op.spec, shape, dtype=torch.float32, initial_state=False)
    packed = count(op, inputs, form=form, chunk_size=chunk).total
    separate = 0
    for start, end in pairwise(cu):
        one = {n: t[:, start:end] for n, t in inputs.items() if n != "cu_seqlens"}
        separate += count(op, one, form=form, chunk_size=chunk).total
    assert packed <= 2.5 * separate, f"packed: {packed} elements computed, separate calls: {separate}"
