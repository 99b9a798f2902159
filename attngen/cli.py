"""attngen's command line: explain, check, compile, tune, bench.

torch, sympy and jinja are imported inside the commands, not here: `attngen --help` and
`attngen --version` stay fast (importing torch alone takes seconds)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import __version__
from .spec import SpecError

DTYPES = ("float64", "float32", "bfloat16", "float16")
# The benchmark shape (BENCHMARKS.md): `tune` and `bench` without --shapes.
BENCH_SHAPE = "4,8192,16,128,128"


def _shape(text: str) -> tuple[int, int, int, int, int]:
    """B,T,H,K,V as five positive integers (a testing.Shape inside the commands)."""
    try:
        B, T, H, K, V = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B,T,H,K,V (five integers), got {text!r}") from None
    if min(B, T, H, K, V) < 1:
        raise argparse.ArgumentTypeError(f"every size must be >= 1, got {text!r}")
    return B, T, H, K, V


def _ranks(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    """--budget: seconds, a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds, a finite number >= 0, got {text!r}")
    return value


def _routes_apart(spec, device: str, head_dim: int) -> bool:
    """Whether bf16 inputs of this head dim run elsewhere than float32 ones (runtime.route)."""
    import torch

    from .runtime import route
    try:
        return route(spec, device, torch.bfloat16, head_dim) != route(spec, device, torch.float32, head_dim)
    except ValueError:
        return False


def _machine_device() -> str:
    """Where the kernels would run on this machine: CUDA if torch sees a GPU, else the CPU."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def cmd_explain(args) -> int:
    import torch

    from . import planner, tuning
    from .runtime import backend, check_call, load, route, runs_as
    from .testing import Shape, random_inputs
    op = load(args.spec)
    if args.ranks is not None:
        planner.check_ranks(args.ranks, args.shape[1])  # before any output
    print(planner.explain(op.plan))
    shape = Shape(*args.shape)
    call = check_call(op, random_inputs(op.spec, shape, initial_state=False))
    choice = op.choose(call)
    B, T, H, K, V = shape.batch, shape.q_len, shape.heads, shape.head_dim, shape.value_dim
    print(f"\nfor shape B={B} T={T} H={H} K={K} V={V}: form {choice.form}"
          f"{f', chunk {choice.chunk}' if choice.form == 'chunked' else ''} ({choice.reason})")
    device = _machine_device()
    print(f"backend on this machine (ATTNGEN_BACKEND={backend()}, {device} tensors):")
    rows = (("float32, bfloat16, float16", torch.float32), ("float64", torch.float64))
    if _routes_apart(op.spec, device, K):
        rows = (("float32, float16", torch.float32), ("bfloat16", torch.bfloat16), ("float64", torch.float64))
    for label, dtype in rows:
        try:
            name, reason = route(op.spec, device, dtype, K)
        except ValueError as e:
            print(f"  {label} inputs: none: {e}")
            continue
        print(f"  {label} inputs: {name}, {runs_as(op.spec, choice, call, name, device, dtype)} ({reason})")
    form, chunk = planner.kernel_form(op.spec, choice, call)
    family = planner.launch_family(op.spec, form)
    if family is not None:
        for dtype in (torch.bfloat16, torch.float32):
            chosen = tuning.choose(op.spec, family, call, dtype, device, chunk)
            print(f"{family} kernel launch, {tuning.dtype_name(dtype)}: {chosen.launch.describe()}\n"
                  f"  {chosen.source}")
    if args.ranks is not None:
        print("\n" + planner.explain_parallel(op.spec, args.ranks, B, T, H, K, V))
    return 0


def _variants(op):
    from .planner import KERNEL_CHUNKS
    for form in op.plan.forms:
        if form.name == "chunked":
            for c in KERNEL_CHUNKS:
                yield form.name, c
        else:
            yield form.name, None


def cmd_check(args) -> int:
    import torch

    from .runtime import backend, check_call, load, route, runs_as
    from .testing import Shape, compare, random_inputs
    shape = Shape(*args.shape)
    # three packed sequences of 2T + 1 tokens in all: 5, T - 2 and T - 2 tokens (1, T and T where T < 3)
    T = shape.q_len
    cuts = (5, T + 3) if T > 2 else (1, T + 1)
    shapes = [shape, Shape(1, T * 2 + 1, shape.heads, shape.head_dim, shape.value_dim,
                           cu_seqlens=(0, *cuts, T * 2 + 1))]
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
                    call = check_call(op, inputs)
                    runs = runs_as(op.spec, op.choose(call, form, chunk), call, name, device, dtype)
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
    if args.output.exists() and not args.output.is_dir():
        raise ValueError(f"-o/--output: {str(args.output)!r} is a file, not a directory; allowed: a directory "
                         f"(created if missing)")
    for path in args.specs:
        spec = load_spec(path)
        try:
            out = codegen.compile_to(spec, args.output)
        except OSError as e:
            raise ValueError(f"-o/--output: cannot write {spec.name}.py into {str(args.output)!r}: "
                             f"{e.strerror or e} ({e.filename or args.output}); allowed: a directory this user "
                             f"can create or write") from None
        forms = ", ".join(f.name for f in planner.plan(spec).forms)
        print(f"{spec.name}: {out} (hash {spec.hash}; forms {forms})")
    return 0


# Named shape sets of `tune --shapes`: typical training shapes, 16K and 128K tokens per step (B2 and
# B16 at T8192) at a hidden size of 2048 in heads of K = V = 64, 128 and 256.
SHAPE_SETS = {"training": tuple(f"{b},8192,{2048 // d},{d},{d}" for d in (64, 128, 256) for b in (2, 16))}


def _shapes(text: str):
    """B,T,H,K,V[,Tq[,H_kv]] as a testing.Shape (testing.parse_shape), an argparse error if malformed."""
    from .testing import parse_shape
    try:
        return parse_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--shapes: ")) from None


def _knobs(text: str) -> dict[str, int]:
    """--seed: knob=value,... of a launch dataclass (planner.parse_knobs); the spec's family checks the names."""
    from . import planner
    try:
        knobs = planner.parse_knobs(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not knobs:
        raise argparse.ArgumentTypeError(f"expected knob=value,... (e.g. dq_BM=64,dq_warps=8), got {text!r}")
    return knobs


def _shape_list(text: str) -> list:
    """One shape, or a named set of them (SHAPE_SETS)."""
    return [_shapes(t) for t in SHAPE_SETS[text]] if text in SHAPE_SETS else [_shapes(text)]


def _baselines(text: str) -> tuple[str, ...]:
    from .bench import BASELINES
    names = tuple(n for n in text.split(",") if n)
    bad = [n for n in names if n not in BASELINES + ("none",)]
    if bad:
        raise argparse.ArgumentTypeError(f"{', '.join(bad)} is not a baseline; allowed: "
                                         f"{', '.join(BASELINES)} (comma-separated), or none")
    return tuple(n for n in names if n != "none")


def _passes(text: str) -> tuple[bool, ...]:
    """fwd, bwd or both (comma-separated, in that order of timing) as bench.run's backward flags."""
    names = [n for n in text.split(",") if n]
    if not names or any(n not in ("fwd", "bwd") for n in names) or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"expected fwd, bwd or fwd,bwd, got {text!r}")
    return tuple(n == "bwd" for n in names)


def _specs(paths):
    """Every spec loaded before any work starts: a bad one is an error naming it."""
    from .spec import load_spec
    return [load_spec(p) for p in paths]


def cmd_tune(args) -> int:
    import torch

    from . import planner, tuning
    from .testing import format_shape
    specs = _specs(args.specs)
    if not torch.cuda.is_available():
        print("attngen tune: no CUDA GPU here (torch.cuda.is_available() is False): tuning times the kernels on "
              "the GPU that will run them; run it there", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    report = lambda line: print(line, flush=True)  # noqa: E731
    for spec in specs:
        if planner.launch_family(spec) is None:
            report(f"{spec.name}: skipped: its kernels (recurrent, bidirectional) take no launch knobs")
            continue
        given = [s for group in args.shapes or [[_shapes(BENCH_SHAPE)]] for s in group]
        shapes = [s for s in given if not spec.is_linear or not (s.k_len or s.kv_heads)]
        if len(shapes) < len(given):
            report(f"{spec.name}: shapes with Tq or H_kv skipped: those are for softmax specs")
        if args.missing:
            done = tuning.tuned_shapes(spec, dtype, tuning.machine("cuda"), args.out)
            skipped = [format_shape(s) for s in shapes if format_shape(s) in done]
            if skipped:
                report(f"{spec.name}: in the table already, skipped (--missing): {' '.join(skipped)}")
            shapes = [s for s in shapes if format_shape(s) not in done]
        if shapes:
            tuning.tune(spec, shapes, dtype, "cuda", report=report, directory=args.out, budget_s=args.budget,
                        seeds=tuple(args.seed or ()))
    return 0


def cmd_bench(args) -> int:
    import torch

    from . import bench
    specs = _specs(args.specs)
    reason = bench.no_device_reason() or (bench.check_plot_support() if args.plot else None)
    if reason:
        print(f"attngen bench: {reason}", file=sys.stderr)
        return 1
    shapes = args.shapes or [_shapes(BENCH_SHAPE)]
    shapes = bench.sweep(shapes[0]) if args.plot and len(shapes) == 1 else shapes
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # the baselines' triton.autotune results kept on disk in Triton's cache (fla autotunes each op
    # for 20-155 s on its first call): a second run times their best configurations at once
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    report = lambda line: print(line, flush=True)  # noqa: E731
    passes = args.passes or (args.bwd,)
    rows = bench.run(specs, shapes, getattr(torch, args.dtype), device, passes, args.vs, report=report,
                     profile_kernels=args.profile)
    if args.plot:
        bench.plot(rows, args.plot)
        report(f"wrote {args.plot}")
    return 1 if any(r.impl == "attngen" and r.note.startswith("failed") for r in rows) else 0


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

    tune_dtypes = ("bfloat16", "float16", "float32")
    p = sub.add_parser("tune", help="search the kernels' launch knobs on this GPU and write the winners to a table")
    p.add_argument("specs", type=Path, nargs="+")
    p.add_argument("--shapes", type=_shape_list, nargs="+", default=None, metavar="B,T,H,K,V[,Tq]",
                   help=f"shapes to tune at (T the keys' length; Tq the queries', softmax decode), or "
                        f"{', '.join(SHAPE_SETS)} ({' '.join(SHAPE_SETS['training'])}); default {BENCH_SHAPE}")
    p.add_argument("--dtype", choices=tune_dtypes, default="bfloat16")
    p.add_argument("--out", type=Path, default=None,
                   help="directory of the table (default: $ATTNGEN_TUNE_DIR, else $ATTNGEN_CACHE/tune; the shipped "
                        "tables are attngen/tables)")
    p.add_argument("--budget", type=_seconds, default=None, metavar="SECONDS",
                   help="seconds of search per spec and shape, shared by its passes (forward, backward), after "
                        "which the best launch so far stands")
    p.add_argument("--seed", type=_knobs, action="append", metavar="KNOB=VALUE,...",
                   help="a launch the search also times at the start, as these knobs over each shape's default "
                        "(e.g. a bench/probe_launch.py winner); repeatable")
    p.add_argument("--missing", action="store_true",
                   help="only the shapes the table in --out holds no entry of for the spec (its hash) and dtype: "
                        "resumes a refill")
    p.set_defaults(fn=cmd_tune)

    p = sub.add_parser("bench", help="time the kernels against the baseline of the same semantics (fla, SDPA, Flex)")
    p.add_argument("specs", type=Path, nargs="+")
    p.add_argument("--shapes", type=_shapes, nargs="+", default=None, metavar="B,T,H,K,V[,Tq[,H_kv]]",
                   help=f"default {BENCH_SHAPE}")
    p.add_argument("--vs", type=_baselines, default="fla,sdpa,flex",
                   help="baselines, comma-separated: fla, sdpa, flex, or none (default: all that apply)")
    p.add_argument("--dtype", choices=tune_dtypes, default="bfloat16")
    passes = p.add_mutually_exclusive_group()
    passes.add_argument("--bwd", action="store_true", help="time forward + backward (default: forward)")
    passes.add_argument("--passes", type=_passes, default=None, metavar="fwd,bwd",
                        help="fwd, bwd (forward + backward) or both in one process: the baselines compile and "
                             "autotune once")
    p.add_argument("--profile", action="store_true", help="each implementation's GPU kernels and their time under its row")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="draw time against sequence length (one shape given: T from 1K to 128K at its B*T)")
    p.set_defaults(fn=cmd_bench)

    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (SpecError, ValueError) as e:
        print(f"attngen: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
