"""attngen.algebra: the per-operator printers (torch and Triton), derivatives, the
unsupported-function errors and the FAVOR+ random features."""
from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import sympy as sp
import torch

from attngen.algebra import (
    NAMED_MAPS,
    TorchPrinter,
    TritonPrinter,
    derivative,
    favor_random_features,
    torch_function,
    torch_source,
    triton_source,
    x,
)

REPO = Path(__file__).resolve().parents[1]
R = sp.Rational


# --------------------------------------------------------------------------- oracles

def sympy_values(expr: sp.Expr, pts: torch.Tensor) -> torch.Tensor:
    """sympy's own numeric evaluation, one Python float at a time."""
    f = sp.lambdify(x, expr, modules="math")
    return torch.tensor([float(f(float(p))) for p in pts], dtype=torch.float64)


def _tensor(a):
    # Triton turns Python scalars into tensors (semantic.to_tensor); do the same here.
    return a if isinstance(a, torch.Tensor) else torch.tensor(a, dtype=torch.float64)


def _lift(fn):
    return lambda *args: fn(*[_tensor(a) for a in args])


# A stand-in for triton.language built from torch, to run printed Triton source on the CPU.
FAKE_TL = types.SimpleNamespace(
    exp=_lift(torch.exp), log=_lift(torch.log), sqrt=_lift(torch.sqrt), abs=_lift(torch.abs),
    sin=_lift(torch.sin), cos=_lift(torch.cos), sigmoid=_lift(torch.sigmoid),
    maximum=_lift(torch.maximum), minimum=_lift(torch.minimum),
    where=lambda c, a, b: torch.where(c, _tensor(a), _tensor(b)),
)


def run_triton_source(expr: sp.Expr, pts: torch.Tensor) -> torch.Tensor:
    src = triton_source(expr)
    value = eval(compile(src, "<triton source>", "eval"), {"tl": FAKE_TL}, {"x": pts})
    return torch.broadcast_to(_tensor(value), pts.shape).to(torch.float64)


def run_torch(expr: sp.Expr, pts: torch.Tensor) -> torch.Tensor:
    return torch.broadcast_to(_tensor(torch_function(expr)(pts)), pts.shape).to(torch.float64)


def points(domain: tuple[float, float], n: int = 64, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    lo, hi = domain
    return lo + (hi - lo) * torch.rand(n, generator=gen, dtype=torch.float64)


ANY = (-3.0, 3.0)
POS = (0.1, 3.0)

# (id, expression, domain of the random points, exact torch source, exact Triton source);
# None where the exact text is not pinned.
OPERATORS = [
    ("add", x + 2, ANY, "(2.0 + x)", "(2.0 + x)"),
    ("mul", 3 * x * sp.exp(x), ANY, "(3.0 * x * torch.exp(x))", "(3.0 * x * tl.exp(x))"),
    ("div", x / (x**2 + 1), ANY, "(x / ((1.0 + (x * x))))", "(x / ((1.0 + (x * x))))"),
    ("div_expr", sp.exp(x) / (x + 4), ANY, None, None),
    ("rational_coeff", R(3, 7) * x, ANY, "(3.0 * x / (7.0))", "(3.0 * x / (7.0))"),
    ("rational_term", x + R(1, 3), ANY, "((1.0 / 3.0) + x)", "((1.0 / 3.0) + x)"),
    ("rational_neg", x - R(5, 2), ANY, None, None),
    ("integer_neg", -3 * x, ANY, "(-3.0 * x)", "(-3.0 * x)"),
    ("integer_sub", x - 1, ANY, "(-1.0 + x)", "(-1.0 + x)"),
    ("float", sp.Float(0.25) * x, ANY, "(0.25 * x)", "(0.25 * x)"),
    ("float_term", x + sp.Float(1.5e-3), ANY, None, None),
    ("pow_int_small", x**3, ANY, "(x * x * x)", "(x * x * x)"),
    ("pow_int_large_odd", x**7, ANY, "torch.pow(x, 7.0)", "(x * tl.exp(6.0 * tl.log(tl.abs(x))))"),
    ("pow_int_large_even", x**6, ANY, "torch.pow(x, 6.0)", "tl.exp(6.0 * tl.log(tl.abs(x)))"),
    ("pow_neg_small", x**-2, ANY, "(1.0 / (x * x))", "(1.0 / (x * x))"),
    ("pow_neg_large", x**-7, ANY, "torch.pow(x, -7.0)", "(x * tl.exp(-8.0 * tl.log(tl.abs(x))))"),
    ("pow_neg_in_mul", 2 * x**-5 + x, ANY, None, None),
    ("pow_half", sp.sqrt(x), POS, "torch.sqrt(x)", "tl.sqrt(x)"),
    ("pow_neg_half", 1 / sp.sqrt(x), POS, "(1.0 / torch.sqrt(x))", "(1.0 / tl.sqrt(x))"),
    ("pow_neg_three_halves", x**R(-3, 2), POS, None, None),
    ("pow_float", x**sp.Float(2.5), POS, "torch.pow(x, 2.5)", "tl.exp((2.5 * tl.log(x)))"),
    ("pow_rational", x**R(1, 3), POS, "torch.pow(x, (1.0 / 3.0))", "tl.exp((tl.log(x) / (3.0)))"),
    ("pow_const_base", 2**x, ANY, "torch.pow(2.0, x)", "tl.exp((x * 0.6931471805599453))"),
    ("pow_general", x**x, POS, "torch.pow(x, x)", "tl.exp((x * tl.log(x)))"),
    ("pow_of_sum", (x**2 + 1) ** 5, ANY, None, None),
    ("exp", sp.exp(x), ANY, "torch.exp(x)", "tl.exp(x)"),
    ("exp_neg", sp.exp(-x**2), ANY, None, None),
    ("log", sp.log(x), POS, "torch.log(x)", "tl.log(x)"),
    ("log1p_exp", sp.log(1 + sp.exp(x)), ANY, None, None),
    ("sqrt", sp.sqrt(x**2 + 1), ANY, None, None),
    ("tanh", sp.tanh(x), ANY, "torch.tanh(x)", "(2.0 * tl.sigmoid(2.0 * x) - 1.0)"),
    ("sin", sp.sin(x), ANY, "torch.sin(x)", "tl.sin(x)"),
    ("cos", sp.cos(x), ANY, "torch.cos(x)", "tl.cos(x)"),
    ("sinh", sp.sinh(x), ANY, "(0.5 * (torch.exp(x) - torch.exp((-1.0 * x))))",
     "(0.5 * (tl.exp(x) - tl.exp((-1.0 * x))))"),
    ("cosh", sp.cosh(x), ANY, "(0.5 * (torch.exp(x) + torch.exp((-1.0 * x))))",
     "(0.5 * (tl.exp(x) + tl.exp((-1.0 * x))))"),
    ("abs", sp.Abs(x), ANY, "torch.abs(x)", "tl.abs(x)"),
    ("max_const", sp.Max(x, 0), ANY, "torch.clamp(x, min=0.0)", "tl.maximum(0.0, x)"),
    ("max_expr", sp.Max(x, sp.exp(x) - 2), ANY, None, None),
    ("max_three", sp.Max(x, sp.sin(x), R(1, 2)), ANY, None, None),
    ("min_const", sp.Min(x, 1), ANY, "torch.clamp(x, max=1.0)", "tl.minimum(1.0, x)"),
    ("min_three", sp.Min(x, sp.sin(x), sp.cos(x)), ANY,
     "torch.minimum(torch.minimum(x, torch.sin(x)), torch.cos(x))",
     "tl.minimum(tl.minimum(x, tl.sin(x)), tl.cos(x))"),
    ("piecewise_gt", sp.Piecewise((x, x > 1), (2 * x, True)), ANY,
     "torch.where((x > 1.0), x, (2.0 * x))", "tl.where((x > 1.0), x, (2.0 * x))"),
    ("piecewise_ge", sp.Piecewise((x, x >= 1), (2 * x, True)), ANY,
     "torch.where((x >= 1.0), x, (2.0 * x))", "tl.where((x >= 1.0), x, (2.0 * x))"),
    ("piecewise_lt", sp.Piecewise((x, x < 1), (2 * x, True)), ANY,
     "torch.where((x < 1.0), x, (2.0 * x))", "tl.where((x < 1.0), x, (2.0 * x))"),
    ("piecewise_le", sp.Piecewise((x, x <= 1), (2 * x, True)), ANY,
     "torch.where((x <= 1.0), x, (2.0 * x))", "tl.where((x <= 1.0), x, (2.0 * x))"),
    ("piecewise_three", sp.Piecewise((x, x < -1), (x**2, x < 1), (2 * x, True)), ANY,
     "torch.where((x < -1.0), x, torch.where((x < 1.0), (x * x), (2.0 * x)))",
     "tl.where((x < -1.0), x, tl.where((x < 1.0), (x * x), (2.0 * x)))"),
    ("piecewise_eq", sp.Piecewise((x, sp.Eq(x, 0)), (x + 1, True)), ANY,
     "torch.where((x == 0.0), x, (1.0 + x))", "tl.where((x == 0.0), x, (1.0 + x))"),
    ("sign", sp.sign(x), ANY, "torch.where(x > 0, 1.0, torch.where(x < 0, -1.0, 0.0))",
     "tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))"),
    ("heaviside", sp.Heaviside(x), ANY, "torch.where(x > 0, 1.0, 0.0)", "tl.where(x > 0, 1.0, 0.0)"),
    ("heaviside_shifted", sp.Heaviside(x - R(1, 2)), ANY, None, None),
    ("pi", sp.pi * x, ANY, f"({math.pi!r} * x)", f"({math.pi!r} * x)"),
    ("e", sp.E + x, ANY, f"({math.e!r} + x)", f"({math.e!r} + x)"),
    ("constant_subexpr", sp.sqrt(2) * x + sp.log(3), ANY, None, None),
    ("elu_plus_one", NAMED_MAPS["elu_plus_one"], ANY,
     "torch.where((x > 0.0), (1.0 + x), torch.exp(x))", "tl.where((x > 0.0), (1.0 + x), tl.exp(x))"),
    ("relu", NAMED_MAPS["relu"], ANY, "torch.where((x > 0.0), x, 0.0)", "tl.where((x > 0.0), x, 0.0)"),
    ("identity", NAMED_MAPS["identity"], ANY, "x", "x"),
]
OP_IDS = [op[0] for op in OPERATORS]


@pytest.mark.parametrize("name, expr, domain, torch_text, triton_text", OPERATORS, ids=OP_IDS)
def test_torch_printer(name, expr, domain, torch_text, triton_text):
    if torch_text is not None:
        assert torch_source(expr) == torch_text
        assert TorchPrinter().doprint(expr) == torch_text
    pts = points(domain)
    torch.testing.assert_close(run_torch(expr, pts), sympy_values(expr, pts), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name, expr, domain, torch_text, triton_text", OPERATORS, ids=OP_IDS)
def test_triton_printer(name, expr, domain, torch_text, triton_text):
    if triton_text is not None:
        assert triton_source(expr) == triton_text
        assert TritonPrinter().doprint(expr) == triton_text
    pts = points(domain, seed=1)
    torch.testing.assert_close(run_triton_source(expr, pts), sympy_values(expr, pts), rtol=1e-10, atol=1e-12)


def test_printer_variable_name():
    assert torch_source(sp.exp(x) + x, var="b_k") == "(b_k + torch.exp(b_k))"
    assert triton_source(sp.Max(x, 0), var="b_q") == "tl.maximum(0.0, b_q)"


def test_integer_powers_keep_the_sign_of_negative_bases():
    # exp(n log x) alone is NaN for x < 0; b^n must be exact there for both back ends.
    pts = torch.tensor([-2.0, -0.5, 0.5, 2.0], dtype=torch.float64)
    for n in (5, 6, 7, -5, -6, 9):
        want = pts**n
        torch.testing.assert_close(run_torch(x**n, pts), want, rtol=1e-12, atol=0)
        torch.testing.assert_close(run_triton_source(x**n, pts), want, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- derivatives

DERIVATIVE_CASES = [
    ("elu_plus_one", NAMED_MAPS["elu_plus_one"], ANY),
    ("relu", NAMED_MAPS["relu"], ANY),
    ("identity", NAMED_MAPS["identity"], ANY),
    ("exp_sin", sp.exp(x) * sp.sin(x), ANY),
    ("tanh_squared", sp.tanh(x) ** 2, ANY),
    ("softplus", sp.log(1 + sp.exp(x)), ANY),
    ("sqrt_quadratic", sp.sqrt(x**2 + 1), ANY),
    ("abs_times_x", sp.Abs(x) * x, ANY),
    ("max_squared", sp.Max(x, 0) ** 2, ANY),
    ("min_cos", sp.Min(x, sp.cos(x)), ANY),
    ("piecewise_user", sp.Piecewise((x**2, x > R(1, 2)), (x, True)), ANY),
    ("cosh_ratio", sp.cosh(x) / (1 + x**2), ANY),
    ("pow7", x**7, ANY),
    ("pow_general", x**x, POS),
    ("log", sp.log(x), POS),
    # Too many pieces to fold into one Piecewise: the derivative keeps them where they are.
    ("piecewise_product", sp.Mul(*(sp.Piecewise((x + i, x > R(i, 3)), (sp.exp(x), True)) for i in range(4))), ANY),
]


@pytest.mark.parametrize("name, expr, domain", DERIVATIVE_CASES, ids=[c[0] for c in DERIVATIVE_CASES])
def test_derivative_matches_autograd_and_finite_differences(name, expr, domain):
    pts = points(domain, n=48, seed=2)
    d = derivative(expr)
    got = run_torch(d, pts)

    xt = pts.clone().requires_grad_(True)
    y = torch_function(expr)(xt)
    (grad,) = torch.autograd.grad(torch.broadcast_to(_tensor(y), xt.shape).sum(), xt, allow_unused=True)
    grad = torch.zeros_like(pts) if grad is None else grad
    torch.testing.assert_close(got, grad, rtol=1e-10, atol=1e-12)

    h = 1e-6
    fd = (run_torch(expr, pts + h) - run_torch(expr, pts - h)) / (2 * h)
    torch.testing.assert_close(got, fd, rtol=1e-5, atol=1e-6)

    # The Triton printing of the derivative agrees too.
    torch.testing.assert_close(run_triton_source(d, pts), got, rtol=1e-10, atol=1e-12)


def test_named_map_derivatives_are_the_textbook_ones():
    assert derivative(NAMED_MAPS["identity"]) == 1
    pts = points(ANY, seed=3)
    torch.testing.assert_close(run_torch(derivative(NAMED_MAPS["relu"]), pts), (pts > 0).double())
    torch.testing.assert_close(run_torch(derivative(NAMED_MAPS["elu_plus_one"]), pts),
                               torch.where(pts > 0, torch.ones_like(pts), torch.exp(pts)))


# --------------------------------------------------------------------------- unsupported

UNSUPPORTED = [
    ("gamma", sp.gamma(x)),
    ("erf", sp.erf(x)),
    ("atan", sp.atan(x)),
    ("tan", sp.tan(x)),
    ("floor", sp.floor(x)),
    ("asinh", sp.asinh(x)),
    ("mod", sp.Mod(x, 2)),
    ("undefined_function", sp.Function("f")(x)),
    ("nested_unsupported", sp.exp(sp.erf(x)) + x),
    ("other_symbol", x + sp.Symbol("y")),
    ("imaginary", sp.I * x),
    ("infinity", sp.oo * x),
    ("complex_infinity", sp.zoo + x),
    ("nan", sp.nan + x),
    ("piecewise_without_true", sp.Piecewise((x, x > 0))),
]


@pytest.mark.parametrize("printer", [TorchPrinter, TritonPrinter], ids=["torch", "triton"])
@pytest.mark.parametrize("name, expr", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_expression_raises_value_error(printer, name, expr):
    with pytest.raises(ValueError):
        printer().doprint(expr)


# --------------------------------------------------------------------------- FAVOR+

def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


FAVOR_CONFIGS = [(64, 16, True, 0), (40, 16, True, 7), (64, 32, False, 3), (10, 16, True, 1)]


def test_favor_features_deterministic_in_process():
    for cfg in FAVOR_CONFIGS:
        a, b = favor_random_features(*cfg), favor_random_features(*cfg)
        assert torch.equal(a, b)
        assert a.dtype == torch.float64 and a.device.type == "cpu"
    # A caller mutating its copy does not change the next draw.
    a = favor_random_features(*FAVOR_CONFIGS[0])
    a.zero_()
    assert not torch.equal(a, favor_random_features(*FAVOR_CONFIGS[0]))


def test_favor_features_identical_in_a_fresh_process():
    code = (
        "import hashlib\n"
        "from attngen.algebra import favor_random_features\n"
        f"for cfg in {FAVOR_CONFIGS!r}:\n"
        "    t = favor_random_features(*cfg).contiguous()\n"
        "    print(hashlib.sha256(t.numpy().tobytes()).hexdigest())\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [_digest(favor_random_features(*cfg)) for cfg in FAVOR_CONFIGS]


@pytest.mark.parametrize("features, head_dim", [(64, 16), (40, 16), (10, 16), (16, 16), (1, 1), (7, 3)])
def test_favor_features_shape(features, head_dim):
    for orthogonal in (True, False):
        omega = favor_random_features(features, head_dim, orthogonal, 0)
        assert omega.shape == (features, head_dim)
        assert torch.isfinite(omega).all()


@pytest.mark.parametrize("features, head_dim", [(64, 16), (40, 16), (10, 16), (24, 8)])
def test_favor_orthogonal_blocks(features, head_dim):
    omega = favor_random_features(features, head_dim, True, 5)
    for start in range(0, features, head_dim):
        block = omega[start:start + head_dim]
        gram = block @ block.T
        norms = torch.sqrt(torch.diagonal(gram))
        off = gram / (norms[:, None] * norms[None, :]) - torch.eye(block.shape[0], dtype=torch.float64)
        assert off.abs().max() < 1e-10, (start, off.abs().max())


def test_favor_orthogonal_rows_have_gaussian_norms():
    # Chi-distributed row norms: E|w|^2 = K, as for a Gaussian row.
    head_dim = 16
    omega = favor_random_features(512, head_dim, True, 11)
    assert abs((omega**2).sum(1).mean().item() - head_dim) < 0.15 * head_dim


def test_favor_seeds_differ():
    for orthogonal in (True, False):
        a = favor_random_features(64, 16, orthogonal, 0)
        b = favor_random_features(64, 16, orthogonal, 1)
        assert not torch.allclose(a, b)


def test_favor_unstructured_is_standard_gaussian():
    omega = favor_random_features(512, 512, False, 0)   # 262144 draws
    assert abs(omega.mean().item()) < 0.01
    assert abs(omega.var().item() - 1.0) < 0.02
    # Not orthogonal: the Gram matrix of a block has off-diagonal mass.
    block = omega[:64, :64]
    gram = block @ block.T
    assert (gram - torch.diag(torch.diagonal(gram))).abs().max() > 1.0


def test_the_planners_identity_fragments_are_the_printed_ones():
    """planner.kernel_spec takes the identity map's Triton fragments without sympy: they are what
    the printer gives for x and its derivative."""
    from attngen import algebra, planner

    expr = algebra.feature_expr("identity", None)
    assert planner.IDENTITY_SOURCE == algebra.triton_source(expr)
    assert planner.IDENTITY_GRAD_SOURCE == algebra.triton_source(algebra.derivative(expr))
