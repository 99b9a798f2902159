"""The recurrent form's backward kernels (through Triton's interpreter) against the gradients of
the float64 interpreter of the spec: q, k, v, g, beta and initial_state, with a loss on the
output and on the final state. Every test checks that the generated backward ran (not the
PyTorch fallback) and poisons fresh buffers with NaN, so an unwritten gradient element fails."""

import pytest
import torch

import attngen
from attngen import codegen
from attngen.reference import reference
from attngen.testing import Shape, compare, random_inputs, rel_error, tolerance

import specs

# Every test_gradients case; the tests after it also name further branches of the template from
# specs.CAUSAL_LINEAR: the constant decay's forward-mode dg with the delta rule (delta_constant)
# and with the normalizer (sum_constant).
SPECS = specs.causal_linear("recurrent_bwd")


pytestmark = pytest.mark.usefixtures("triton_backend", "poison_fresh_buffers")


@pytest.fixture
def kernel_op(monkeypatch):
    """name -> (op, calls): the op of a spec with its module's recurrent_bwd counted."""
    def make(name):
        op = attngen.load(specs.CAUSAL_LINEAR[name])
        module = codegen.load_module(op.spec)
        assert "recurrent" in module.BACKWARD_FORMS
        real, calls = module.recurrent_bwd, []

        def counted(*args):
            calls.append(args[-1] is not None)  # whether a loss reached the final state
            return real(*args)

        monkeypatch.setattr(module, "recurrent_bwd", counted)
        return op, calls
    return make


def check(op, calls, shape, dtype, **kw):
    inputs = random_inputs(op.spec, shape, **kw)
    rows = compare(op.spec, lambda **args: op(**args, form="recurrent"), inputs, dtype, with_grads=True)
    assert calls, "the generated recurrent backward did not run"
    bad = [f"{name}: rel err {err:.2e} > tol {tol:.2e}" for name, err, tol in rows if not err <= tol]
    assert not bad, "; ".join(bad)
    names = {name for name, _, _ in rows}
    assert {"dq", "dk", "dv"} <= names
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SPECS))
def test_gradients(kernel_op, name, dtype):
    """Every spec family, K != V, initial state on."""
    op, calls = kernel_op(name)
    names = check(op, calls, Shape(2, 7, 2, 8, 6), dtype)
    assert "dinitial_state" in names and ("dg" in names) == (op.spec.decay != "none")


@pytest.mark.parametrize("name,T,initial_state", [
    ("gated_deltanet", 1, True), ("linear_transformer", 1, False),
    ("kda", 33, False), ("delta_constant", 33, True), ("performer", 33, False),
])
def test_lengths(kernel_op, name, T, initial_state):
    """A single token (decode) and sequences longer than the recurrent form's default range."""
    op, calls = kernel_op(name)
    names = check(op, calls, Shape(1, T, 2, 8, 5), torch.float32, initial_state=initial_state)
    assert ("dinitial_state" in names) == initial_state


@pytest.mark.parametrize("name,dtype,initial_state", [
    ("kda", torch.float32, True), ("performer", torch.bfloat16, False),
    ("mamba2", torch.float32, False), ("expr_l2_sum", torch.float32, True), ("sum_constant", torch.float32, True),
])
def test_varlen(kernel_op, name, dtype, initial_state):
    """Packed sequences, one of them a single token; each has its own initial state."""
    op, calls = kernel_op(name)
    check(op, calls, Shape(1, 12, 2, 6, 5, cu_seqlens=(0, 1, 5, 12)), dtype, initial_state=initial_state)


@pytest.mark.parametrize("name", ["gated_deltanet", "gla", "retnet", "expr_l2_sum"])
def test_strong_decay(kernel_op, name):
    """Decays down to exp(-20) per token: the reverse-cumsum dg and the state passes stay exact."""
    op, calls = kernel_op(name)
    check(op, calls, Shape(2, 9, 1, 8, 4), torch.float32, decay_strength=20.0)


@pytest.mark.parametrize("name", ["kda", "sum_constant", "performer"])
def test_value_blocks(kernel_op, name):
    """V wider than one value block: dq, dk, dbeta, dg and the normalizer's dd are sums of the
    blocks' partials."""
    op, calls = kernel_op(name)
    check(op, calls, Shape(1, 5, 1, 8, 40), torch.float32)


@pytest.mark.parametrize("name", ["gated_deltanet", "performer"])
def test_loss_on_output_only(kernel_op, name):
    """No final state asked for, so no loss reaches it (dht is None): gradients of a loss on o."""
    op, calls = kernel_op(name)
    inputs = random_inputs(op.spec, Shape(2, 6, 2, 8, 5))
    weight = torch.randn(2, 6, 2, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def grads(fn, dtype):
        leaves = {n: t.detach().clone().to(dtype if n in ("q", "k", "v") else t.dtype).requires_grad_(True)
                  for n, t in inputs.items()}
        o, s = fn(**leaves)
        assert s is None
        return torch.autograd.grad((o * weight.to(o.dtype)).sum(), list(leaves.values()))

    want = grads(lambda **kw: reference(op.spec, **kw), torch.float64)
    lowp = grads(lambda **kw: reference(op.spec, **kw, dtype=torch.float32), torch.float32)
    got = grads(lambda **kw: op(**kw, form="recurrent"), torch.float32)
    assert calls == [False]
    for n, a, b, c in zip(inputs, got, want, lowp):
        err, tol = rel_error(a, b), tolerance(torch.float32, rel_error(c, b))
        assert err <= tol, f"d{n}: rel err {err:.2e} > tol {tol:.2e}"
