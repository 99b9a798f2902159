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


def _ranks(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--ranks: expected a positive integer, got {text!r}")
    return int(text)


def _call(op, inputs: dict):
    """The checked call (shapes, lengths) of an op on inputs in the op's signature."""
    from .inputs import check_linear, check_softmax
    q, k, v, g, cu = inputs["q"], inputs["k"], inputs["v"], inputs.get("g"), inputs.get("cu_seqlens")
    if op.spec.is_linear:
        return check_linear(op.spec, q, k, v, g, inputs.get("beta"), None, inputs.get("initial_state"), cu)
    return check_softmax(op.spec, q, k, v, g, None, cu)


def _machine_device() -> str:
    """Where the kernels would run on this machine: CUDA if torch sees a GPU, else the CPU."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def cmd_explain(args) -> int:
    import torch

    from . import planner
    from .runtime import backend, load, route, runs_as
    from .testing import Shape, random_inputs
    op = load(args.spec)
    print(planner.explain(op.plan))
    shape = Shape(*args.shape)
    call = _call(op, random_inputs(op.spec, shape, initial_state=False))
    choice = op.choose(call)
    B, T, H, K, V = shape.batch, shape.q_len, shape.heads, shape.head_dim, shape.value_dim
    print(f"\nfor shape B={B} T={T} H={H} K={K} V={V}: form {choice.form}"
          f"{f', chunk {choice.chunk}' if choice.form == 'chunked' else ''} ({choice.reason})")
    device = _machine_device()
    print(f"backend on this machine (ATTNGEN_BACKEND={backend()}, {device} tensors):")
    for label, dtype in (("float32, bfloat16, float16", torch.float32), ("float64", torch.float64)):
        try:
            name, reason = route(op.spec, device, dtype)
        except ValueError as e:
            print(f"  {label} inputs: none: {e}")
            continue
        print(f"  {label} inputs: {name}, {runs_as(op.spec, choice, call, name)} ({reason})")
    if args.ranks is not None:
        print("\n" + planner.explain_parallel(op.spec, args.ranks, B, T, H, K, V))
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

    from .runtime import backend, load, route, runs_as
    from .testing import Shape, compare, random_inputs
    shape = Shape(*args.shape)
    shapes = [shape, Shape(1, shape.q_len * 2 + 1, shape.heads, shape.head_dim, shape.value_dim,
                           cu_seqlens=(0, 5, shape.q_len + 3, shape.q_len * 2 + 1))]
    # The kernels are tested where they run: on CUDA when torch sees a GPU (the interpreter
    # for the oracle stays on the CPU), else on the CPU (Triton's interpreter).
    device = "cpu" if backend() == "torch" else _machine_device()
    header = (f"{'spec':<24s} {'backend':<7s} {'dtype':<8s} {'form':<10s} {'chunk':>5s} {'runs':<22s} "
              f"{'shape':<12s} {'worst':<16s} {'rel err':>9s} {'tol':>9s}  result")
    print(f"ATTNGEN_BACKEND={backend()}, {device} tensors; interpreter in float64 on the CPU")
    print(header)
    print("-" * len(header))
    failures, rows_run, dtypes = 0, 0, set()
    for path in args.specs:
        try:
            op = load(path)
            # Without --dtype: float32 where the kernels run (they compute in float32), float64
            # where the PyTorch forms run (the oracle's precision, to 1e-9).
            dtype = getattr(torch, args.dtype) if args.dtype else \
                (torch.float32 if route(op.spec, device, torch.float32)[0] == "triton" else torch.float64)
            name, _ = route(op.spec, device, dtype)
        except Exception as e:  # a bad spec is reported, and the other specs still run
            failures += 1
            print(f"{str(path):<24s} ERROR   {e if isinstance(e, ValueError) else f'{type(e).__name__}: {e}'}")
            continue
        dname = str(dtype).removeprefix("torch.")
        dtypes.add(dname)
        for form, chunk in _variants(op):
            for shp in shapes:
                label = "varlen" if shp.cu_seqlens else f"B{shp.batch} T{shp.q_len}"
                inputs = random_inputs(op.spec, shp, seed=args.seed)
                prefix = f"{op.spec.name:<24s} {name:<7s} {dname:<8s} {form:<10s} {chunk or '':>5}"
                rows_run += 1
                try:
                    call = _call(op, inputs)
                    runs = runs_as(op.spec, op.choose(call, form, chunk), call, name)
                    fn = lambda **kw: op(**kw, form=form, chunk_size=chunk)  # noqa: B023
                    rows = compare(op.spec, fn, inputs, dtype, with_grads=not args.no_grad, device=device)
                except Exception as e:  # a failing form is a failed row; the other rows still run
                    failures += 1
                    print(f"{prefix} {'':<22s} {label:<12s} ERROR {type(e).__name__}: {e}")
                    continue
                worst, err, tol = max(rows, key=lambda r: r[1] / r[2])
                ok = all(e <= t for _, e, t in rows)
                failures += not ok
                print(f"{prefix} {runs:<22s} {label:<12s} {worst:<16s} {err:9.2e} {tol:9.2e}  "
                      f"{'pass' if ok else 'FAIL'}")
    what = "outputs only" if args.no_grad else "outputs, final states and gradients"
    print(f"\n{'all pass' if not failures else f'{failures} FAILED'} ({rows_run} rows of {len(args.specs)} specs, "
          f"{', '.join(sorted(dtypes)) or 'no dtype'}, {what})")
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
    p.add_argument("--ranks", type=_ranks, default=None,
                   help="context parallel over N ranks (attngen.distributed): the exchange and bytes per rank "
                        "for T split into N shards")
    p.set_defaults(fn=cmd_explain)

    p = sub.add_parser("check", help="every form of every spec against the interpreter")
    p.add_argument("specs", type=Path, nargs="+")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="input dtype (default: float32 where the kernels run, float64 where the PyTorch forms run)")
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
