"""Feature-map algebra: each elementwise feature map as a sympy expression in x, its
derivative, and dedicated printers to PyTorch and Triton source; FAVOR+ random features.

A user's `{expr: ...}` is parsed here under a whitelist: the only symbol is x and the only
functions are the elementwise ones below, so every map can be printed to both back ends.
"""
from __future__ import annotations

import math
import re
from functools import lru_cache

import sympy as sp
from sympy.printing.str import StrPrinter

from .spec import show_value

x = sp.Symbol("x", real=True)

# Functions a feature expression may use: name in the spec -> sympy object.
ALLOWED_FUNCTIONS = {
    "exp": sp.exp, "log": sp.log, "sqrt": sp.sqrt, "tanh": sp.tanh,
    "sin": sp.sin, "cos": sp.cos, "sinh": sp.sinh, "cosh": sp.cosh,
    "Abs": sp.Abs, "abs": sp.Abs, "Max": sp.Max, "max": sp.Max, "Min": sp.Min, "min": sp.Min,
    "Piecewise": sp.Piecewise,
}
_ALLOWED_NAMES = {**ALLOWED_FUNCTIONS, "x": x, "pi": sp.pi, "E": sp.E, "True": sp.true}
_FUNCTION_CLASSES = (sp.exp, sp.log, sp.tanh, sp.sin, sp.cos, sp.sinh, sp.cosh, sp.Abs,
                     sp.Max, sp.Min, sp.Piecewise, sp.Heaviside)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")
_SAFE_CHARS = re.compile(r"[0-9A-Za-z_ .+\-*/(),<>=]*\Z")

NAMED_MAPS = {
    "identity": x,
    "elu_plus_one": sp.Piecewise((x + 1, x > 0), (sp.exp(x), True)),
    "relu": sp.Piecewise((x, x > 0), (sp.Integer(0), True)),
}

_ALLOWED_TEXT = "a sympy expression in x using + - * / ** and " + ", ".join(
    sorted({"exp", "log", "sqrt", "tanh", "sin", "cos", "sinh", "cosh", "Abs", "Max", "Min", "Piecewise"}))


# Bounds on a user expression, so that parsing, checking, differentiating and printing it stay
# fast and within Python's recursion limit (sympy recurses once per level of the tree): the
# raw text, its parenthesis nesting, and the parsed tree's depth and node count.
MAX_EXPR_CHARS = 1000
MAX_EXPR_DEPTH = 32
MAX_EXPR_NODES = 500
# Max and Min compare their arguments pairwise as they are built, and differentiate into a
# term per argument holding the Max of the others, which nesting repeats (a Max of 20 terms
# takes 12 s; Max and Min of 8 terms nested 8 deep, minutes): at most this many arguments of
# Max and Min in the whole expression.
MAX_MINMAX_ARGS = 16
# piecewise_fold multiplies out the pieces of every Piecewise it meets (a product of n two-piece
# maps differentiates into n^2 Piecewise nodes, whose fold takes exponential time): fold only
# when the pieces it could create number at most this many.
MAX_FOLDED_PIECES = 16


def parse_feature_expr(text: str) -> sp.Expr:
    """Parse and check a user feature map; ValueError names the value and what is allowed."""
    if not text.strip():
        raise ValueError(f"value {text!r} is not allowed; allowed: {_ALLOWED_TEXT}")
    if len(text) > MAX_EXPR_CHARS:
        raise ValueError(f"value {show_value(text)} is longer than {MAX_EXPR_CHARS} characters; allowed: "
                         f"{_ALLOWED_TEXT}, at most {MAX_EXPR_CHARS} characters")
    depth = 0
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if depth > MAX_EXPR_DEPTH:
            raise ValueError(f"value {show_value(text)} nests parentheses more than {MAX_EXPR_DEPTH} deep; allowed: "
                             f"{_ALLOWED_TEXT}, nested at most {MAX_EXPR_DEPTH} deep")
    if not _SAFE_CHARS.match(text) or "__" in text or re.search(r"(?<![0-9])\.|\.(?![0-9])", text):
        raise ValueError(f"value {text!r} has characters outside an arithmetic expression; allowed: {_ALLOWED_TEXT}")
    for name in _IDENT.findall(text):
        if name not in _ALLOWED_NAMES and not re.fullmatch(r"[eE][0-9]*", name):
            raise ValueError(f"value {text!r} uses {name!r}, which is not elementwise in x; allowed: {_ALLOWED_TEXT}")
    from sympy.parsing.sympy_parser import parse_expr, standard_transformations
    try:
        kwargs = {"global_dict": _parser_globals(), "transformations": standard_transformations}
        # The shape of the expression first, with every function an inert placeholder: sympy
        # works as it builds (Max compares its arguments pairwise), and the shape's size bounds
        # the work of everything after.
        _check_size(parse_expr(text, local_dict=_placeholders(), evaluate=False, **kwargs), text)
        # The unevaluated tree next: evaluating 9**9**9 would not finish.
        _check_constant_powers(parse_expr(text, local_dict=dict(_ALLOWED_NAMES), evaluate=False, **kwargs), text)
        expr = parse_expr(text, local_dict=dict(_ALLOWED_NAMES), evaluate=True, **kwargs)
    except _TooLarge as e:
        raise ValueError(str(e)) from None
    except Exception as e:  # sympy raises many types for malformed text
        raise ValueError(f"value {text!r} does not parse ({type(e).__name__}: {e}); allowed: {_ALLOWED_TEXT}") from None
    if not isinstance(expr, sp.Expr):
        raise ValueError(f"value {text!r} is not a scalar expression; allowed: {_ALLOWED_TEXT}")
    if expr.has(sp.zoo, sp.nan, sp.oo, -sp.oo):
        raise ValueError(f"value {text!r} is not finite; allowed: {_ALLOWED_TEXT}")
    if expr.free_symbols != {x}:
        raise ValueError(f"value {text!r} must depend on x and on nothing else; allowed: {_ALLOWED_TEXT}")
    for node in sp.preorder_traversal(expr):
        if isinstance(node, sp.Function) and not isinstance(node, _FUNCTION_CLASSES):
            raise ValueError(f"value {text!r} uses {node.func}, which is not allowed; allowed: {_ALLOWED_TEXT}")
        if isinstance(node, (sp.Derivative, sp.Integral)):
            raise ValueError(f"value {text!r} is not elementwise in x; allowed: {_ALLOWED_TEXT}")
    # A map is only legal if both back ends can print it and its derivative (the backward
    # pass needs phi'); e.g. a Piecewise without a final (value, True) piece cannot be.
    try:
        d = derivative(expr)
        for e in (expr, d):
            torch_source(e)
            triton_source(e)
    except ValueError as err:
        raise ValueError(f"value {text!r} cannot be compiled ({err}); allowed: {_ALLOWED_TEXT}") from None
    except RecursionError:  # the bounds above should keep it from happening; never a traceback
        raise ValueError(f"value {show_value(text)} is too deeply nested to compile; allowed: {_ALLOWED_TEXT}, "
                         f"nested at most {MAX_EXPR_DEPTH} deep") from None
    _check_domain(expr, d, text)
    return expr


# --------------------------------------------------------------------------- domain

# A feature map must be real and finite, with a finite derivative (the backward evaluates
# phi'), at every real x: log(x), sqrt(x), x**0.5, 1/x, log(x - 1) and Abs(x)**0.5 (whose
# derivative is infinite at 0) would give NaN or Inf for part of the inputs. Sympy cannot
# decide this for every expression in bounded time, so it is probed where such maps fail: in
# float64, as the PyTorch forms print it, at 0, at tiny and moderate magnitudes, on a grid of
# [-PROBE_RANGE, PROBE_RANGE], and at the real roots of every polynomial under a log, a root
# or a negative power (where a pole or the edge of a domain sits). Overflow within the range
# counts too (exp(exp(x)) is refused; exp(x**2) passes, 5e173 at x = 20).
PROBE_RANGE = 20.0
_PROBE_GRID_STEP = 0.05
_MAX_ROOT_DEGREE = 6


def _probe_points(exprs) -> "np.ndarray":
    import numpy as np
    special = [0.0, 5e-324, 1e-300, 1e-12, 1e-6, 1e-3, 0.1, 0.5, 1.0, 2.0, math.e, math.pi, PROBE_RANGE]
    grid = np.arange(-PROBE_RANGE, PROBE_RANGE + _PROBE_GRID_STEP / 2, _PROBE_GRID_STEP)
    roots = []
    for e in exprs:
        for node in sp.preorder_traversal(e):
            if isinstance(node, sp.log):
                arg = node.args[0]
            elif isinstance(node, sp.Pow) and not (node.exp.is_Integer and node.exp > 0):
                arg = node.base
            else:
                continue
            try:
                poly = sp.Poly(arg, x)
            except sp.PolynomialError:
                continue
            if 0 < poly.degree() <= _MAX_ROOT_DEGREE:
                coeffs = [float(c) for c in poly.all_coeffs()]
                roots += [r.real for r in np.roots(coeffs) if abs(r.imag) < 1e-12 and math.isfinite(r.real)]
    return np.concatenate([np.array(special), -np.array(special), grid, np.array(roots)])


class _NumpyTorch:
    """The torch functions the printer emits, on float64 numpy arrays: NaN and Inf as torch
    gives them (both branches of a where evaluated, the untaken one dropped)."""

    def __getattr__(self, name):
        import numpy as np
        return getattr(np, name)

    @staticmethod
    def clamp(a, min=None, max=None):
        import numpy as np
        return np.clip(a, min, max)

    @staticmethod
    def pow(a, b):
        import numpy as np
        return np.power(a, b)


def _check_domain(expr: sp.Expr, d: sp.Expr, text: str) -> None:
    import numpy as np
    pts = _probe_points((expr, d))
    for what, e in (("", expr), ("its derivative " + str(d) + " ", d)):
        fn = eval(compile(f"lambda x: {torch_source(e)}", "<attngen domain probe>", "eval"), {"torch": _NumpyTorch()})
        with np.errstate(all="ignore"):
            values = np.broadcast_to(np.asarray(fn(pts), dtype=np.float64), pts.shape)
        bad = ~np.isfinite(values)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"value {show_value(text)} is not a feature map on all real x: {what}gives "
                             f"{float(values[i])} at x = {float(pts[i])!r}; allowed: {_ALLOWED_TEXT}, real and finite with a "
                             f"finite derivative for every real x (e.g. log(1 + exp(x)) rather than log(x), "
                             f"sqrt(x**2 + 1) rather than sqrt(x))")


class _TooLarge(Exception):
    pass


@lru_cache(maxsize=1)
def _placeholder_functions() -> dict:
    """Each allowed function name -> an undefined sympy function of the same name, which builds
    a tree node and does nothing else."""
    return {name: sp.Function(getattr(fn, "__name__", name)) for name, fn in ALLOWED_FUNCTIONS.items()}


def _placeholders() -> dict:
    return {**_ALLOWED_NAMES, **_placeholder_functions()}


def _check_size(tree, text: str) -> None:
    """Refuse a tree deeper than MAX_EXPR_DEPTH, larger than MAX_EXPR_NODES, or with more than
    MAX_MINMAX_ARGS arguments of Max and Min (walked without recursion, so the check itself
    cannot overflow the stack)."""
    if not isinstance(tree, sp.Basic):
        return
    stack, nodes, minmax_args = [(tree, 1)], 0, 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if depth > MAX_EXPR_DEPTH:
            raise _TooLarge(f"value {show_value(text)} is nested more than {MAX_EXPR_DEPTH} levels deep; allowed: "
                            f"{_ALLOWED_TEXT}, nested at most {MAX_EXPR_DEPTH} levels deep")
        if nodes > MAX_EXPR_NODES:
            raise _TooLarge(f"value {show_value(text)} has more than {MAX_EXPR_NODES} terms; allowed: "
                            f"{_ALLOWED_TEXT}, of at most {MAX_EXPR_NODES} terms")
        if getattr(node.func, "__name__", "") in ("Max", "Min"):
            minmax_args += len(node.args)
            if minmax_args > MAX_MINMAX_ARGS:
                raise _TooLarge(f"value {show_value(text)} has more than {MAX_MINMAX_ARGS} arguments of Max and Min; "
                                f"allowed: {_ALLOWED_TEXT}, with at most {MAX_MINMAX_ARGS} arguments of Max and "
                                "Min in all")
        stack.extend((arg, depth + 1) for arg in node.args)


_MAX_CONSTANT_EXPONENT = 1024


def _check_constant_powers(tree, text: str) -> None:
    """Refuse a constant raised to a huge rational power: sympy would compute it exactly."""
    if not isinstance(tree, sp.Basic):
        return
    for node in sp.postorder_traversal(tree):  # inner powers first, so each doit() is cheap
        if isinstance(node, sp.Pow) and not node.base.free_symbols and not node.exp.free_symbols:
            e = node.exp.doit()
            if e.is_Rational and abs(e) > _MAX_CONSTANT_EXPONENT:
                raise _TooLarge(f"value {text!r} raises a constant to the power {e}, beyond "
                                f"{_MAX_CONSTANT_EXPONENT}; allowed: {_ALLOWED_TEXT}")


@lru_cache(maxsize=1)
def _parser_globals() -> dict:
    # What sympy's transformations emit (Integer(2), Float('0.5'), Symbol, ...; with
    # evaluate=False also the operator classes) and nothing else.
    return {"Integer": sp.Integer, "Float": sp.Float, "Rational": sp.Rational, "Symbol": sp.Symbol,
            "Add": sp.Add, "Mul": sp.Mul, "Pow": sp.Pow, "Lt": sp.Lt, "Le": sp.Le, "Gt": sp.Gt,
            "Ge": sp.Ge, "Eq": sp.Eq, "Ne": sp.Ne}


def feature_expr(feature_map: str, feature_expr_text: str | None = None) -> sp.Expr:
    """The elementwise map phi(x) of a spec's feature_map (not favor_plus)."""
    if feature_map == "expr":
        return parse_feature_expr(feature_expr_text or "")
    if feature_map not in NAMED_MAPS:
        raise ValueError(f"feature_map {feature_map!r} is not elementwise; allowed: {', '.join(NAMED_MAPS)}, expr")
    return NAMED_MAPS[feature_map]


def derivative(expr: sp.Expr) -> sp.Expr:
    """d phi / dx. Piecewise factors are folded into one Piecewise when that is cheap
    (MAX_FOLDED_PIECES); otherwise they stay where they are: the printers print a Piecewise
    anywhere in an expression."""
    d = sp.diff(expr, x)
    pieces = 1
    for node in sp.preorder_traversal(d):
        if isinstance(node, sp.Piecewise):
            pieces *= len(node.args)
            if pieces > MAX_FOLDED_PIECES:
                return d
    return sp.piecewise_fold(d)


# --------------------------------------------------------------------------- printers

class _ElementwisePrinter(StrPrinter):
    """Prints an elementwise expression in x to one back end's source. Subclasses name the
    module (`torch` / `tl`) and the few operators that differ."""

    lib = ""

    def __init__(self, var: str = "x"):
        super().__init__({"order": "none"})
        self.var = var

    def _print(self, expr, **kwargs):
        # A constant subexpression (sqrt(2), log(3), pi) becomes one float literal: the back
        # ends' math functions take tensors, not Python numbers. Integers and rationals keep
        # their own printers (exact text, integer exponents).
        if isinstance(expr, sp.Expr) and expr.is_number and not expr.is_Rational:
            # Evaluated in float64, not by evalf: exp(exp(exp(exp(100)))) would not finish there.
            try:
                value = sp.lambdify((), expr, modules="math")()
            except (ArithmeticError, ValueError, TypeError, NameError):  # overflow, math domain, no such name
                value = None
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{expr} is not a finite real number and cannot be printed to {self.lib}")
            return repr(float(value))
        return super()._print(expr, **kwargs)

    def _call(self, fn: str, *args: sp.Expr) -> str:
        return f"{self.lib}.{fn}(" + ", ".join(self._print(a) for a in args) + ")"

    def _print_Symbol(self, expr):
        if expr != x:
            raise ValueError(f"symbol {expr} is not allowed in a feature map; only x")
        return self.var

    def _print_Integer(self, expr):
        return f"{int(expr)}.0"

    def _print_Rational(self, expr):
        return f"({expr.p}.0 / {expr.q}.0)"

    def _print_Float(self, expr):
        return repr(float(expr))

    def _print_Exp1(self, expr):
        return repr(math.e)

    def _print_Pi(self, expr):
        return repr(math.pi)

    def _print_Add(self, expr):
        terms = [self._print(a) for a in expr.args]
        return "(" + " + ".join(terms) + ")"

    def _print_Mul(self, expr):
        num, den = [], []
        for a in expr.args:
            if a.is_Pow and a.exp.is_negative and a.exp.is_Rational:
                den.append(a.base ** -a.exp)
            elif a.is_Rational and a.q != 1:
                num.append(sp.Integer(a.p)) if a.p != 1 else None
                den.append(sp.Integer(a.q))
            else:
                num.append(a)
        top = " * ".join(self._print(a) for a in num) if num else "1.0"
        if not den:
            return f"({top})"
        return f"({top} / (" + " * ".join(self._print(a) for a in den) + "))"

    def _print_Pow(self, expr):
        base, e = expr.base, expr.exp
        if e == sp.Rational(1, 2):
            return self._call("sqrt", base)
        if e == -sp.Rational(1, 2):
            return f"(1.0 / {self._call('sqrt', base)})"
        if e.is_Integer and 0 < abs(int(e)) <= 4:
            prod = " * ".join([self._print(base)] * abs(int(e)))
            return f"({prod})" if e > 0 else f"(1.0 / ({prod}))"
        if e.is_Integer:
            # |b|^n through exp/log, with the sign put back for odd n (b^n = b * |b|^(n-1)):
            # exp(n log b) alone is NaN for every negative base.
            n = int(e)
            b = self._print(base)
            even = f"{self.lib}.exp({n - n % 2}.0 * {self.lib}.log({self.lib}.abs({b})))"
            return even if n % 2 == 0 else f"({b} * {even})"
        if base == sp.E:
            return self._call("exp", e)
        return self._call("exp", e * sp.log(base))

    def _print_exp(self, expr):
        return self._call("exp", expr.args[0])

    def _print_log(self, expr):
        return self._call("log", expr.args[0])

    def _print_sin(self, expr):
        return self._call("sin", expr.args[0])

    def _print_cos(self, expr):
        return self._call("cos", expr.args[0])

    def _print_sinh(self, expr):
        a = expr.args[0]
        return f"(0.5 * ({self._call('exp', a)} - {self._call('exp', -a)}))"

    def _print_cosh(self, expr):
        a = expr.args[0]
        return f"(0.5 * ({self._call('exp', a)} + {self._call('exp', -a)}))"

    def _print_Abs(self, expr):
        return self._call("abs", expr.args[0])

    def _print_Max(self, expr):
        return self._fold("maximum", expr.args)

    def _print_Min(self, expr):
        return self._fold("minimum", expr.args)

    def _fold(self, fn: str, args) -> str:
        out = self._print(args[0])
        for a in args[1:]:
            out = f"{self.lib}.{fn}({out}, {self._print(a)})"
        return out

    def _print_Heaviside(self, expr):
        # d/dx of Max(x, 0) and friends; the value at 0 is 0, as for relu's derivative.
        return f"{self.lib}.where({self._print(expr.args[0])} > 0, 1.0, 0.0)"

    def _print_Piecewise(self, expr):
        *pieces, (last_val, last_cond) = expr.args
        if last_cond != sp.true:
            raise ValueError("a Piecewise feature map needs a final (value, True) piece")
        out = self._print(last_val)
        for val, cond in reversed(pieces):
            out = f"{self.lib}.where({self._print(cond)}, {self._print(val)}, {out})"
        return out

    def _relational(self, expr, op: str):
        return f"({self._print(expr.lhs)} {op} {self._print(expr.rhs)})"

    def _print_StrictGreaterThan(self, expr):
        return self._relational(expr, ">")

    def _print_GreaterThan(self, expr):
        return self._relational(expr, ">=")

    def _print_StrictLessThan(self, expr):
        return self._relational(expr, "<")

    def _print_LessThan(self, expr):
        return self._relational(expr, "<=")

    def _print_Equality(self, expr):
        return self._relational(expr, "==")

    def _print_Unequality(self, expr):
        return self._relational(expr, "!=")

    def _print_And(self, expr):
        return "(" + " & ".join(self._print(a) for a in expr.args) + ")"

    def _print_Or(self, expr):
        return "(" + " | ".join(self._print(a) for a in expr.args) + ")"

    def _print_sign(self, expr):
        a = self._print(expr.args[0])
        return f"{self.lib}.where({a} > 0, 1.0, {self.lib}.where({a} < 0, -1.0, 0.0))"

    def _print_Function(self, expr):
        raise ValueError(f"{expr.func} cannot be printed to {self.lib}")

    def emptyPrinter(self, expr):
        raise ValueError(f"{type(expr).__name__} cannot be printed to {self.lib}")


class TorchPrinter(_ElementwisePrinter):
    lib = "torch"

    def _print_tanh(self, expr):
        return self._call("tanh", expr.args[0])

    def _print_Pow(self, expr):
        small_int = expr.exp.is_Integer and abs(int(expr.exp)) <= 4
        if not (small_int or abs(expr.exp) == sp.Rational(1, 2)) and expr.base != sp.E:
            return f"torch.pow({self._print(expr.base)}, {self._print(expr.exp)})"
        return super()._print_Pow(expr)

    def _fold(self, fn: str, args) -> str:
        # torch.maximum/minimum take two tensors; a constant bound goes through clamp.
        consts = [a for a in args if a.is_number]
        rest = [a for a in args if not a.is_number]
        bound = (sp.Max if fn == "maximum" else sp.Min)(*consts) if consts else None
        if not rest:
            return self._print(bound)
        out = super()._fold(fn, rest)
        if bound is None:
            return out
        return f"torch.clamp({out}, {'min' if fn == 'maximum' else 'max'}={self._print(bound)})"


class TritonPrinter(_ElementwisePrinter):
    lib = "tl"

    def _print_tanh(self, expr):
        # tl has no tanh on every version; 2*sigmoid(2a) - 1 is exact and stays finite.
        return f"(2.0 * tl.sigmoid(2.0 * {self._print(expr.args[0])}) - 1.0)"


def torch_source(expr: sp.Expr, var: str = "x") -> str:
    return TorchPrinter(var).doprint(expr)


def triton_source(expr: sp.Expr, var: str = "x") -> str:
    return TritonPrinter(var).doprint(expr)


@lru_cache(maxsize=64)
def torch_function(expr: sp.Expr):
    """The expression as a Python function of a tensor, built from its printed source."""
    import torch
    code = compile(f"lambda x: {torch_source(expr)}", "<attngen feature map>", "eval")
    return eval(code, {"torch": torch})


# --------------------------------------------------------------------------- FAVOR+

@lru_cache(maxsize=32)
def _favor_features_cached(features: int, head_dim: int, orthogonal: bool, seed: int):
    import torch
    gen = torch.Generator(device="cpu").manual_seed(seed)
    gauss = torch.randn(features, head_dim, generator=gen, dtype=torch.float64)
    if not orthogonal:
        return gauss
    blocks = []
    for _ in range(-(-features // head_dim)):
        q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
        q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()).double())
        blocks.append(q.T)  # rows orthonormal
    omega = torch.cat(blocks)[:features]
    # Chi-distributed row norms keep each row marginally Gaussian (Choromanski et al. 2021).
    norms = torch.linalg.vector_norm(gauss, dim=1, keepdim=True)
    return omega * norms


def favor_random_features(features: int, head_dim: int, orthogonal: bool, seed: int):
    """Omega [features, head_dim], float64 on the CPU: a pure function of its arguments."""
    return _favor_features_cached(features, head_dim, orthogonal, seed).clone()
