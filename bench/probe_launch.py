"""Try chunked launches the planner holds back (GPU): per spec and variant, the oracle check of
tests/gpu (outputs and every gradient at B1 T1000 H2 D128 against the float64 interpreter), the
agreement with the first variant at the timed shape, and the forward + backward time and kernels (with the
sum of the kernels' times: the GPU's busy time, which a host stall between launches does not change, where the
step's wall time can: one launch timed 1.759 and 2.132 ms in one process, its three longest kernels the same; BENCHMARKS.md).

    python bench/probe_launch.py --specs gated_deltanet,mamba2 --variants "bwd_chunk=32;bwd_chunk=64" \
        [--B 4 --T 8192 --H 16 --D 128] [--dtype bfloat16]

A variant is a list of launch knobs set after the planner fitted its launch (its clamps bypassed, a
chunked launch's stages refitted): ChunkedLaunch knobs for linear specs, SoftmaxLaunch knobs (e.g.
"BM=128,warps=8") for softmax ones; the first variant is the reference of the agreement column. This is
how a clamp of planner.fit_chunked is tested before it is lifted: a launch that fails here stays held.
`--from-table FILE` appends to each spec's variants the launch of that tuning table's entry for the
spec at the timed shape (how a shipped table's launches are held to the oracle).

The bidirectional specs' launch is kernel_lib.bidirectional_blocks', not a planner launch: their variants
name a step, "step:knob=value" (step fwd, state or rows: bidirectional_launch's grad; knob BT, BV,
num_warps or num_stages of its meta; BT also sets the span), e.g. "rows:num_stages=1,state:num_stages=3".
"""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attngen  # noqa: E402
from attngen import bench, codegen, kernel_lib, planner, tuning  # noqa: E402
from attngen.testing import Shape, bench_inputs, compare, random_inputs, rel_error  # noqa: E402

SPECS = Path(__file__).resolve().parents[1] / "specs"
_fit = planner.fit_chunked
_fit_softmax = planner.fit_softmax
OVERRIDE: dict[str, int] = {}
BIDIRECTIONAL_STEPS = ("fwd", "state", "rows")
BIDIRECTIONAL_KNOBS = ("BT", "BV", "num_warps", "num_stages")


def _fit_with_override(spec, call, dtype, launch, chunk=None):
    launch = _fit(spec, call, dtype, launch, chunk)
    if not OVERRIDE:
        return launch
    return planner.fit_stages(spec, call, dtype, dataclasses.replace(launch, **OVERRIDE))


def _fit_softmax_with_override(call, launch, dtype):
    launch = _fit_softmax(call, launch, dtype)
    return dataclasses.replace(launch, **OVERRIDE) if OVERRIDE else launch


planner.fit_chunked = _fit_with_override
planner.fit_softmax = _fit_softmax_with_override


def parse_variant(text: str, option: str = "--variants") -> dict[str, int]:
    """'knob=value,...' of ChunkedLaunch (linear specs) or SoftmaxLaunch (softmax ones) (planner.parse_knobs);
    the launch of the spec's family takes them (a knob of the other family fails that variant). The
    bidirectional specs' 'step:knob=value' items are kept as they are named."""
    items = [item for item in text.split(",") if item]
    try:
        knobs = planner.parse_knobs(",".join(item for item in items if ":" not in item))
    except ValueError as e:
        raise SystemExit(f"{option}: {e}") from None
    for item in items:
        if ":" in item:
            name, _, value = item.partition("=")
            step, _, knob = name.partition(":")
            if step not in BIDIRECTIONAL_STEPS or knob not in BIDIRECTIONAL_KNOBS or not value.isdigit():
                raise SystemExit(f"{option}: {item!r}: expected step:knob=value, step one of {BIDIRECTIONAL_STEPS}, "
                                 f"knob one of {BIDIRECTIONAL_KNOBS}, a non-negative integer value")
            knobs[name] = int(value)
    return knobs


def bidirectional_override(real, variant: dict[str, int]):
    """bidirectional_launch with the variant's 'step:knob' values over its meta (BT also sets the span)."""
    def launch(q, v, omega, cu_seqlens, grad=None):
        dims, (splits, span), meta = real(q, v, omega, cu_seqlens, grad)
        over = {k.partition(":")[2]: n for k, n in variant.items() if k.partition(":")[0] == (grad or "fwd")}
        if "BT" in over:
            span = over["BT"] * kernel_lib.BIDIRECTIONAL_SPAN_TILES
        return dims, (splits, span), {**meta, **over}
    return launch


def short_kernel(name: str) -> str:
    """A kernel's name in the table: chunked_bwd_dq_kernel -> bwd_dq; a C++ template's arguments dropped."""
    return name.replace("chunked_", "").replace("bidirectional_", "").replace("_kernel", "").split("<")[0]


def output(result):
    """The output of an op's result: linear ops return (o, final_state), softmax ones o."""
    return result[0] if isinstance(result, tuple) else result


def grads(op, inputs):
    o = output(op(**inputs))
    gen = torch.Generator(device=o.device).manual_seed(3)
    gout = torch.randn(o.shape, device=o.device, generator=gen).to(o.dtype)
    names = [n for n, t in inputs.items() if t.requires_grad]
    gs = torch.autograd.grad(o, [inputs[n] for n in names], gout)
    return {"o": o.detach(), **{"d" + n: g for n, g in zip(names, gs)}}


def table_variant(path: str, name: str, args) -> str | None:
    """The launch of a table's entry for spec `name` at the probe's timed shape (a chunked or softmax
    launch; a decode shape's entry has a sixth size and is not this shape's), as a variant."""
    import json
    shape = f"{args.B},{args.T},{args.H},{args.D},{args.D}"
    for row in json.loads(Path(path).read_text())["entries"]:
        if row["spec"] == name and row["shape"] == shape and row["dtype"] == args.dtype and row["kernel"] in ("chunked", "softmax"):
            return ",".join(f"{k}={v}" for k, v in row["launch"].items())
    return None


def spec_variants(args, name: str) -> list[str]:
    variants = args.variants.split(";") if args.variants is not None else []
    if args.from_table:
        found = table_variant(args.from_table, name, args)
        variants += [found] if found else []
    return variants


def isolated(args) -> int:
    table = []
    for name in args.specs.split(","):
        for variant in spec_variants(args, name):
            cmd = [sys.executable, __file__, "--specs", name, "--variants", variant, "--B", str(args.B), "--T", str(args.T),
                   "--H", str(args.H), "--D", str(args.D), "--dtype", args.dtype, "--kernels", str(args.kernels)] + (["--no-oracle"] if args.no_oracle else []) + (
                ["--module", args.module] if args.module else [])
            out = subprocess.run(cmd, capture_output=True, text=True).stdout.strip().splitlines()
            line = out[-1] if out and out[-1].startswith(name) else f"{name:<20s} {variant:<34s} no result: {(out or ['?'])[-1][:200]}"
            print(line, flush=True)
            table.append(line)
    print("\n".join(["", "spec / variant / fwd, fwd+bwd ms / worst oracle error over tolerance"] + table))
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--specs", required=True)
    p.add_argument("--variants", default=None, help="';'-separated variants, each 'knob=value,...' ('' = the planner's); "
                   "required without --from-table")
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-oracle", action="store_true")
    p.add_argument("--kernels", type=int, default=6, help="how many of the step's kernels to list, longest first")
    p.add_argument("--module", default=None, metavar="FILE", help="an edited rendering of the spec's generated module "
                   "(one spec) run in place of the rendering: how a kernel edit is timed and held to the oracle before "
                   "it goes into a template")
    p.add_argument("--from-table", default=None, metavar="FILE", help="also each spec's launch in this tuning table")
    p.add_argument("--isolate", action="store_true", help="each spec and variant in a process of its own (an illegal "
                   "address leaves the process's CUDA context unusable); no agreement column then")
    args = p.parse_args()
    if args.variants is None and not args.from_table:
        p.error("--variants is required without --from-table")
    if args.module and ("," in args.specs or not Path(args.module).is_file()):
        p.error(f"--module {args.module!r}: one file, for one spec (--specs {args.specs!r})")
    for v in (args.variants or "").split(";"):
        parse_variant(v)
    if args.isolate:
        return isolated(args)
    dtype = getattr(torch, args.dtype)
    table = []
    for name in args.specs.split(","):
        if args.module:
            # the edited module, imported before the op is made, under the name codegen.load_module
            # gives the spec's rendering
            spec = attngen.spec.load_spec(SPECS / f"{name}.yaml")
            codegen.load_edited_module(spec, Path(args.module))
        op = attngen.load(SPECS / f"{name}.yaml")
        bidirectional = op.spec.is_linear and op.spec.mask == "bidirectional"
        module = codegen.load_module(op.spec) if bidirectional else None
        real = module.bidirectional_launch if bidirectional else None
        shape = Shape(batch=args.B, q_len=args.T, heads=args.H, head_dim=args.D, value_dim=args.D)
        big = bench_inputs(op.spec, shape, dtype, "cuda", requires_grad=True)
        small = random_inputs(op.spec, Shape(batch=1, q_len=1000, heads=2, head_dim=args.D, value_dim=args.D), seed=7)
        ref = None
        for variant in map(parse_variant, spec_variants(args, name)):
            stepped = {k: v for k, v in variant.items() if ":" in k}
            OVERRIDE.clear()
            OVERRIDE.update({k: v for k, v in variant.items() if ":" not in k})
            tuning._remembered.cache_clear()
            label = ",".join(f"{k}={v}" for k, v in variant.items()) or "planner"
            try:
                if (OVERRIDE if bidirectional else stepped):
                    raise ValueError("bidirectional specs take step:knob=value knobs, the others knob=value")
                if bidirectional:
                    module.bidirectional_launch = bidirectional_override(real, stepped)
                    launch = f"bidirectional_blocks' with {stepped or 'nothing'} over it"
                else:
                    launch = tuning.choose(op.spec, planner.launch_family(op.spec), attngen.runtime.check_call(op, big),
                                           dtype, "cuda").launch
                worst = "-"
                if not args.no_oracle:
                    rows = compare(op.spec, lambda **kw: op(**kw), small, dtype, with_grads=True, device="cuda")
                    worst = max(rows, key=lambda r: r[1] / r[2])
                    worst = f"{worst[0]} {worst[1] / worst[2]:.2f}"
                got = grads(op, big)
                agree = "-" if ref is None else f"{max(rel_error(got[n].float(), ref[n].float()) for n in ref):.1e}"
                ref = ref or got
                with torch.no_grad():
                    fwd_ms = bench.do_bench_timer(False)(lambda: output(op(**big)))
                run = bench.step(lambda: output(op(**big)), True, big)
                ms = bench.do_bench_timer(True)(run)
                prof = bench.profile(run)
                kernels = ", ".join(f"{short_kernel(k)} {us:.0f}" for k, us in prof[:args.kernels])
                # the GPU's time in the step's kernels, which host gaps between them do not change
                busy = sum(us for _, us in prof) / 1e3
                line = (f"{name:<20s} {label:<34s} fwd {fwd_ms:6.3f}  fwd+bwd {ms:8.3f} ms (kernels {busy:6.3f})  "
                        f"oracle(err/tol) {worst:<14s} vs first {agree:<8s} | {kernels}")
                print(f"   launch {launch}", flush=True)
            except Exception as e:  # noqa: BLE001 -- a failing variant is a row saying why
                line = f"{name:<20s} {label:<34s} failed: {type(e).__name__}: {str(e)[:200]}"
            print(line, flush=True)
            table.append(line)
        if bidirectional:
            module.bidirectional_launch = real
    print("\n".join(["", "spec / variant / fwd, fwd+bwd ms (the sum of its kernels' times) / worst oracle error over tolerance / "
                          "largest rel diff from the first variant"] + table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
