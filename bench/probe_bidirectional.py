"""Launch variants of the bidirectional kernels (GPU): per spec and variant, the oracle check (outputs and
gradients at B1 T1000 H2 D128 bf16 against the float64 interpreter), fwd+bwd ms at B4 T8192 H16 D128 bf16
and the kernels' times.

    python3 bench/probe_bidirectional.py performer_bidirectional ";rows:BT=64,rows:num_warps=4;state:num_stages=3"

A variant: a comma-separated list of step:knob=value (step fwd, state or rows: bidirectional_launch's grad) over the
launch's meta (BT, BV, num_warps, num_stages); BT also sets the span (BT x the span's tiles); the first
variant "" is the launch as planned. PROBE_FAVOR=split: FAVOR+'s projections of 16-bit inputs as three bf16
dots of hi / lo parts instead of tf32x3 (kernel_lib.favor_dot replaced in this process).
"""
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attngen  # noqa: E402
from attngen import bench, codegen, kernel_lib  # noqa: E402
from attngen.testing import Shape, bench_inputs, compare, random_inputs  # noqa: E402

SPECS = Path(__file__).resolve().parents[1] / "specs"

if os.environ.get("PROBE_FAVOR") == "split":
    # FAVOR+'s projections of 16-bit inputs as three bf16 dots of hi / lo parts (about 2^-16 relative)
    # instead of tf32x3
    @triton.jit
    def favor_dot_split(a, b, BK: tl.constexpr, PRECISION: tl.constexpr):
        if PRECISION == "f64":
            c = tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee")
        elif (PRECISION == "bf16" or PRECISION == "tf32") and BK <= 128:
            a_hi = a.to(tl.bfloat16)
            a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
            b_hi = b.to(tl.bfloat16)
            b_lo = (b - b_hi.to(tl.float32)).to(tl.bfloat16)
            c = tl.dot(a_hi, b_lo)
            c = tl.dot(a_lo, b_hi, c)
            c = tl.dot(a_hi, b_hi, c)
        else:
            c = tl.dot(a, b, input_precision="ieee")
        return c
    kernel_lib.favor_dot = favor_dot_split


def parse(text):
    out = {}
    for item in filter(None, text.split(",")):
        step, rest = item.split(":")
        key, value = rest.split("=")
        out.setdefault(step, {})[key] = int(value)
    return out


def main():
    names, variants = sys.argv[1].split(","), [parse(v) for v in sys.argv[2].split(";")]
    for name in names:
        op = attngen.load(SPECS / f"{name}.yaml")
        module = codegen.load_module(op.spec)
        real = module.bidirectional_launch
        for variant in variants:
            def patched(q, v, omega, cu_seqlens, grad=None, variant=variant):
                dims, (splits, span), meta = real(q, v, omega, cu_seqlens, grad)
                over = variant.get(grad or "fwd", {})
                meta = {**meta, **over}
                if "BT" in over:
                    span = over["BT"] * kernel_lib.BIDIRECTIONAL_SPAN_TILES
                return dims, (splits, span), meta
            module.bidirectional_launch = patched
            knobs = ",".join(f"{s}:{k}={v}" for s, kv in variant.items() for k, v in kv.items()) or "default"
            label = " ".join(filter(None, (os.environ.get("PROBE_FAVOR"), knobs)))
            try:
                small = Shape(batch=1, q_len=1000, heads=2, head_dim=128, value_dim=128)
                rows = compare(op.spec, lambda **kw: op(**kw), random_inputs(op.spec, small, seed=3), torch.bfloat16,
                               with_grads=True, device="cuda")
                worst = max(e / t for _, e, t in rows)
                inputs = bench_inputs(op.spec, Shape(4, 8192, 16, 128, 128), torch.bfloat16, "cuda", requires_grad=True)
                run = bench.step(lambda: op(**inputs)[0], True, inputs)
                run()
                ms = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
                kernels = bench.profile(run)[:6]
                short = lambda k: k.replace("bidirectional_", "").replace("_kernel", "").split("<")[0]  # noqa: E731
                print(f"{name:24s} {label:44s} oracle {worst:5.2f} of tol   fwd+bwd {ms:7.3f} ms   "
                      + "  ".join(f"{short(k)} {us:.0f}" for k, us in kernels), flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name:24s} {label:44s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        module.bidirectional_launch = real


if __name__ == "__main__":
    main()
