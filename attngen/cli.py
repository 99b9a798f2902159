"""attngen's command line: explain, check, compile.

torch, sympy and jinja are imported inside the commands, not here: `attngen --help` and
`attngen --version` stay fast (importing torch alone takes seconds)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import __version__
from .spec import SpecError

DTYPES = ("float64", "float32", "bfloat16", "float16")


def _shape(text: str) -> tuple[int, int, int, int, int]:
    """B,T,H,K,V as five positive integers (a testing.Shape inside the commands)."""
    try:
        B, T, H, K, V = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape: expected B,T,H,K,V (five integers), got {text!r}") from None
    if min(B, T, H, K, V) < 1:
        raise argparse.ArgumentTypeError(f"--shape: every size must be >= 1, got {text!r}")
    return B, T, H, K, V


def cmd_explain(args) -> int:
    from . import planner
    from .inputs import check_linear, check_softmax
    from .runtime import load
    from .testing import Shape, random_inputs
    op = load(args.spec)
    print(planner.explain(op.plan))
    shape = Shape(*args.shape)
    inputs = random_inputs(op.spec, shape, initial_state=False)
    if op.spec.is_linear:
        call = check_linear(op.spec, inputs["q"], inputs["k"], inputs["v"], inputs.get("g"), inputs.get("beta"))
    else:
        call = check_softmax(op.spec, inputs["q"], inputs["k"], inputs["v"], inputs.get("g"))
    choice = op.choose(call)
    B, T, H, K, V = shape.batch, shape.q_len, shape.heads, shape.head_dim, shape.value_dim
    print(f"\nfor shape B={B} T={T} H={H} K={K} V={V}: form {choice.form}"
          f"{f', chunk {choice.chunk}' if choice.form == 'chunked' else ''} ({choice.reason})")
    return 0


def _variants(op):
    for form in op.plan.forms:
        if form.name == "chunked":
            for c in (16, 32, 64):
                yield form.name, c
        else:
            yield form.name, None


def cmd_check(args) -> int:
    import torch

    from .runtime import load
    from .testing import Shape, compare, random_inputs
    dtype = getattr(torch, args.dtype)
    shape = Shape(*args.shape)
    shapes = [shape, Shape(1, shape.q_len * 2 + 1, shape.heads, shape.head_dim, shape.value_dim,
                           cu_seqlens=(0, 5, shape.q_len + 3, shape.q_len * 2 + 1))]
    header = f"{'spec':<24s} {'form':<10s} {'chunk':>5s} {'shape':<12s} {'worst':<16s} {'rel err':>9s} {'tol':>9s}  result"
    print(header)
    print("-" * len(header))
    failures = 0
    for path in args.specs:
        op = load(path)
        for form, chunk in _variants(op):
            for shape in shapes:
                inputs = random_inputs(op.spec, shape, seed=args.seed)
                fn = lambda **kw: op(**kw, form=form, chunk_size=chunk)  # noqa: B023
                rows = compare(op.spec, fn, inputs, dtype, with_grads=not args.no_grad)
                name, err, tol = max(rows, key=lambda r: r[1] / r[2])
                ok = all(e <= t for _, e, t in rows)
                failures += not ok
                label = "varlen" if shape.cu_seqlens else f"B{shape.batch} T{shape.q_len}"
                print(f"{op.spec.name:<24s} {form:<10s} {chunk or '':>5} {label:<12s} {name:<16s} "
                      f"{err:9.2e} {tol:9.2e}  {'pass' if ok else 'FAIL'}")
    print(f"\n{'all pass' if not failures else f'{failures} FAILED'} ({args.dtype}, "
          f"{'outputs only' if args.no_grad else 'outputs, final states and gradients'})")
    return 1 if failures else 0


def cmd_compile(args) -> int:
    from . import codegen, planner
    from .spec import load_spec
    for path in args.specs:
        spec = load_spec(path)
        out = codegen.compile_to(spec, args.output)
        forms = ", ".join(f.name for f in planner.plan(spec).forms)
        print(f"{spec.name}: {out} (hash {spec.hash}; forms {forms})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attngen", description="A compiler for attention kernels.")
    parser.add_argument("--version", action="version", version=f"attngen {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("explain", help="semantics, legal forms, stage DAGs, and the form chosen for a shape")
    p.add_argument("spec", type=Path)
    p.add_argument("--shape", type=_shape, default="1,4096,16,128,128", help="B,T,H,K,V")
    p.set_defaults(fn=cmd_explain)

    p = sub.add_parser("check", help="every form of every spec against the interpreter")
    p.add_argument("specs", type=Path, nargs="+")
    p.add_argument("--dtype", choices=DTYPES, default="float64")
    p.add_argument("--shape", type=_shape, default="2,50,2,8,6", help="B,T,H,K,V")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-grad", action="store_true", help="outputs only")
    p.set_defaults(fn=cmd_check)

    p = sub.add_parser("compile", help="generate the Triton module of each spec (generated/<name>.py)")
    p.add_argument("specs", type=Path, nargs="+")
    p.add_argument("-o", "--output", type=Path, default=Path("generated"))
    p.set_defaults(fn=cmd_compile)

    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (SpecError, ValueError) as e:
        print(f"attngen: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
