"""Forward (and fwd+bwd) timings of attngen against flash-linear-attention, SDPA and
FlexAttention on the same inputs, in one process (BENCHMARKS.md method: do_bench median,
random inputs, outputs checked in the same run).

    python bench/bench.py [--bwd] [--profile] [--cases gdn,delta,...] [--B 4 --T 8192 --H 16 --D 128]

Prints a table; each row also gives the relative difference between attngen and the baseline
output and the roofline floor (bytes of q, k, v, o at the measured copy bandwidth).
--profile adds, under each row, attngen's GPU kernels and their time per call (torch.profiler).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attngen  # noqa: E402

SPECS = Path(__file__).resolve().parents[1] / "specs"
COPY_TBPS = 4.3e12     # measured device-to-device copy, H200 (BENCHMARKS.md)


def make_step(fn, bwd, inputs):
    """fn itself, or (bwd) a forward + backward step of it with a fixed output gradient,
    clearing the inputs' .grad after each."""
    if not bwd:
        return fn
    out = fn()
    out = out[0] if isinstance(out, tuple) else out
    grad = torch.randn_like(out)

    def step():
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)
        for t in inputs:
            t.grad = None
    return step


def bench(fn, bwd=False, inputs=()):
    step = make_step(fn, bwd, inputs)
    if not bwd:
        return triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
    return triton.testing.do_bench(step, warmup=10, rep=50, return_mode="median")


def profile(fn, bwd, inputs, reps=5):
    """[(kernel name, microseconds per call)] of fn's GPU kernels, slowest first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step = make_step(fn, bwd, inputs)
    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / reps) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def make(B, T, H, D, dtype, grad, **extra):
    """Random inputs; extras: g_scalar, g_vector, g_const, beta (True), kv_heads (H_kv), q_len (Tq)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    Hkv, Tq = extra.get("kv_heads", H), extra.get("q_len", T)
    t = {"q": r(B, Tq, H, D), "k": r(B, T, Hkv, D), "v": r(B, T, Hkv, D)}
    t = {n: x.to(dtype) for n, x in t.items()}
    if "g_scalar" in extra:
        t["g"] = F.logsigmoid(r(B, T, H) + 3).float()
    if "g_vector" in extra:
        t["g"] = F.logsigmoid(r(B, T, H, D) + 3).float()
    if "g_const" in extra:
        t["g"] = -torch.linspace(0.01, 0.2, H, device="cuda")
    if "beta" in extra:
        t["beta"] = torch.sigmoid(r(B, T, H)).to(dtype)
    for x in t.values():
        x.requires_grad_(grad)
    return t


def fla(module, name):
    """The fla op fla.ops.<module>.<name>, imported when the baseline first runs (fla is optional:
    without it a row times attngen alone and says why)."""
    def run(*args, **kw):
        import importlib
        return getattr(importlib.import_module(f"fla.ops.{module}"), name)(*args, **kw)
    return run


def cases(args):
    """name -> (attngen spec, input extras, baseline name, baseline fn(inputs) -> o)."""
    if args.bwd:
        try:
            # fla refuses its gated backward on Hopper with Triton < 3.7.1 (fla issue #640: wrong
            # dβ/dg there). Its time is still the baseline's time: the guard is turned off for
            # timing; only outputs are compared, never its gradients.
            import fla.ops.common.chunk_o as fla_chunk_o
            if not fla_chunk_o.TRITON_ABOVE_3_7_1:
                fla_chunk_o.TRITON_ABOVE_3_7_1 = True
                print("fla: gated backward timed with its Triton < 3.7.1 guard off (gradients not compared)")
        except ImportError as e:
            print(f"fla unavailable ({e}): its rows time attngen alone")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention)
    B, T, H = args.B, args.T, args.H
    causal = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, T, T)
    window = create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv < 1024), None, None, T, T)
    to_bhtd = lambda x: x.transpose(1, 2)
    chunk_gated_delta_rule = fla("gated_delta_rule", "chunk_gated_delta_rule")
    chunk_delta_rule = fla("delta_rule", "chunk_delta_rule")
    chunk_simple_gla = fla("simple_gla", "chunk_simple_gla")
    chunk_gla = fla("gla", "chunk_gla")
    chunk_kda = fla("kda", "chunk_kda")
    chunk_linear_attn = fla("linear_attn", "chunk_linear_attn")
    out = {}
    out["gdn"] = ("gated_deltanet", ("g_scalar", "beta"), "fla chunk_gated_delta_rule",
                  lambda t: chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"],
                                                   use_qk_l2norm_in_kernel=True)[0])
    out["delta"] = ("deltanet", ("beta",), "fla chunk_delta_rule",
                    lambda t: chunk_delta_rule(t["q"], t["k"], t["v"], t["beta"], use_qk_l2norm_in_kernel=True)[0])
    out["mamba2"] = ("mamba2", ("g_scalar",), "fla chunk_simple_gla",
                     lambda t: chunk_simple_gla(t["q"], t["k"], t["v"], g=t["g"])[0])
    out["retnet"] = ("retnet", ("g_const",), "fla chunk_simple_gla g_gamma",
                     lambda t: chunk_simple_gla(t["q"], t["k"], t["v"], g_gamma=t["g"])[0])
    out["gla"] = ("gla", ("g_vector",), "fla chunk_gla",
                  lambda t: chunk_gla(t["q"], t["k"], t["v"], t["g"])[0])
    out["kda"] = ("kda", ("g_vector", "beta"), "fla chunk_kda",
                  lambda t: chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], use_qk_l2norm_in_kernel=True)[0])
    out["linear"] = ({"name": "linear_attention", "attention": "linear"}, (), "fla chunk_linear_attn",
                     lambda t: chunk_linear_attn(t["q"], t["k"], t["v"], normalize=False)[0])
    out["linear_elu_sum"] = ("linear_transformer", (), "fla chunk_linear_attn + elu+1 in torch",
                             lambda t: chunk_linear_attn(F.elu(t["q"]) + 1, F.elu(t["k"]) + 1, t["v"],
                                                         normalize=True)[0])
    out["softmax_causal"] = ("softmax_causal", (), "FlexAttention causal",
                             lambda t: to_bhtd(flex(to_bhtd(t["q"]), to_bhtd(t["k"]), to_bhtd(t["v"]), block_mask=causal)))
    out["softmax_causal_sdpa"] = ("softmax_causal", (), "SDPA causal",
                                  lambda t: to_bhtd(F.scaled_dot_product_attention(
                                      to_bhtd(t["q"]), to_bhtd(t["k"]), to_bhtd(t["v"]), is_causal=True)))
    # decode: one query against the whole cache (B from --B); grouped-query heads H = 32 over 8
    out["decode_sdpa"] = ("softmax_causal", (("q_len", 1),), "SDPA decode (Tq 1)",
                          lambda t: to_bhtd(F.scaled_dot_product_attention(
                              to_bhtd(t["q"]), to_bhtd(t["k"]), to_bhtd(t["v"]))))
    out["decode_flex"] = ("softmax_causal", (("q_len", 1),), "FlexAttention decode (Tq 1)",
                          lambda t: to_bhtd(flex(to_bhtd(t["q"]), to_bhtd(t["k"]), to_bhtd(t["v"]))))
    gqa_mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, T, T)
    out["gqa_flex"] = ("softmax_causal", (("kv_heads", 8),), "FlexAttention causal enable_gqa (H 32, H_kv 8)",
                       lambda t: to_bhtd(flex(to_bhtd(t["q"]), to_bhtd(t["k"]), to_bhtd(t["v"]), block_mask=gqa_mask,
                                              enable_gqa=True)))
    out["sliding_window"] = ("sliding_window", (), "FlexAttention window 1024",
                             lambda t: to_bhtd(flex(to_bhtd(t["q"]), to_bhtd(t["k"]), to_bhtd(t["v"]), block_mask=window)))
    del B, H
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--bwd", action="store_true")
    p.add_argument("--cases", default="")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-baseline", action="store_true", help="time attngen alone (no baseline call, no autotune)")
    args = p.parse_args()
    dtype = torch.bfloat16
    table = cases(args)
    wanted = [c for c in args.cases.split(",") if c] or list(table)
    kind = "fwd+bwd" if args.bwd else "fwd"
    print(f"\nB{args.B} T{args.T} H{args.H} D{args.D} bf16, {kind}, do_bench median (ms)")
    print(f"{'case':<20s} {'baseline':<40s} {'attngen':>8s} {'base':>8s} {'ratio':>6s} {'rel diff':>9s} {'floor':>6s}  note")
    for name in wanted:
        spec, extras, base_name, base_fn = table[name]
        op = attngen.load(SPECS / f"{spec}.yaml" if isinstance(spec, str) else spec)
        extra = dict(e if isinstance(e, tuple) else (e, True) for e in extras)
        H = 32 if "kv_heads" in extra else args.H
        t = make(args.B, args.T, H, args.D, dtype, args.bwd, **extra)
        ours = (lambda: op(**t)[0]) if op.spec.is_linear else (lambda: op(**t))
        try:
            t0 = time.time()
            o = ours()
            torch.cuda.synchronize()
            first = time.time() - t0
            ms = bench(ours, args.bwd, list(t.values()))
        except Exception as e:  # noqa: BLE001
            print(f"{name:<20s} {base_name:<40s} attngen failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        nbytes = sum(x.numel() * x.element_size() for x in (t["q"], t["k"], t["v"])) + o.numel() * o.element_size()
        floor_ms = nbytes / COPY_TBPS * 1e3
        base = f"{'-':>8s} {'-':>6s} {'-':>9s}"
        try:  # a baseline may refuse a case (fla's backward guards on Hopper with Triton < 3.7.1)
            if not args.no_baseline:
                diff = rel(o.detach(), base_fn(t).detach())
                base_ms = bench(lambda: base_fn(t), args.bwd, list(t.values()))
                base = f"{base_ms:8.3f} {ms / base_ms:6.2f} {diff:9.2e}"
        except Exception as e:  # noqa: BLE001
            print(f"{name:<20s} {base_name:<40s} baseline failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
        print(f"{name:<20s} {base_name:<40s} {ms:8.3f} {base} {floor_ms:6.3f}  first call {first:.1f}s, "
              f"{nbytes / ms / 1e9:.2f} TB/s of q, k, v, o", flush=True)
        if args.profile:
            for kernel, us in profile(ours, args.bwd, list(t.values()))[:8]:
                print(f"    {us:9.1f} us  {kernel[:90]}", flush=True)


if __name__ == "__main__":
    main()
