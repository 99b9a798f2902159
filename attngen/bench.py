"""`attngen bench`: a spec's kernels against the baseline of the same semantics, in one process
on the same inputs (BENCHMARKS.md's method): do_bench medians, outputs checked against each other
in the same run, TFLOP/s, the fraction of the memory floor reached, peak memory.

The baseline comes from the spec's semantics, where one computes the same function:
- delta rule, l2-normalised q and k: scalar decay -> fla chunk_gated_delta_rule, none ->
  chunk_delta_rule, vector -> chunk_kda;
- additive rule, no q/k normalisation: scalar decay -> fla chunk_simple_gla, constant ->
  chunk_simple_gla with g_gamma, vector -> chunk_gla, none -> chunk_linear_attn (with elu + 1
  features and normalize sum: chunk_linear_attn normalize=True on the features);
- softmax: SDPA (causal or no mask, no decay; grouped-query heads included) and FlexAttention
  (the matching block mask, end-aligned; the forgetting decay as a score_mod); the forgetting
  decay (causal or sliding window, Tq = Tk) also fla parallel_forgetting_attn.
Other specs (other feature maps, FAVOR+, ...) run attngen alone. Without a GPU, or without the
baseline's package, the command says so in one line.
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from .spec import LOG_DECAY_FLOOR, Spec
from .testing import Shape, bench_inputs, format_shape

BASELINES = ("fla", "sdpa", "flex")
SEQ_SWEEP = tuple(1024 << i for i in range(8))      # --plot: T from 1K to 128K


# ---------------------------------------------------------------------------- baselines
@dataclasses.dataclass(frozen=True)
class Baseline:
    name: str                               # what it is, in words
    source: str                             # fla | sdpa | flex
    fn: Callable[[dict], torch.Tensor]      # inputs -> o [B, Tq, H, V]


def _fla(module: str, name: str):
    import importlib
    return getattr(importlib.import_module(f"fla.ops.{module}"), name)


def _linear_baselines(spec: Spec, scale: float) -> list[Baseline]:
    if spec.mask != "causal":
        return []
    delta, decay, l2 = spec.update == "delta", spec.decay, spec.qk_norm == "l2"
    if spec.feature_map != "identity":
        if spec.feature_map == "elu_plus_one" and not delta and decay == "none" and not l2 and spec.normalize == "sum":
            return [Baseline("fla chunk_linear_attn + elu+1 in torch", "fla", lambda t: _fla(
                "linear_attn", "chunk_linear_attn")(F.elu(t["q"]) + 1, F.elu(t["k"]) + 1, t["v"], scale=scale,
                                                   normalize=True)[0])]
        return []
    if delta and l2:
        if decay == "scalar":
            return [Baseline("fla chunk_gated_delta_rule", "fla", lambda t: _fla(
                "gated_delta_rule", "chunk_gated_delta_rule")(t["q"], t["k"], t["v"], t["g"], t["beta"], scale=scale,
                                                            use_qk_l2norm_in_kernel=True)[0])]
        if decay == "none":
            return [Baseline("fla chunk_delta_rule", "fla", lambda t: _fla("delta_rule", "chunk_delta_rule")(
                t["q"], t["k"], t["v"], t["beta"], scale=scale, use_qk_l2norm_in_kernel=True)[0])]
        if decay == "vector":
            return [Baseline("fla chunk_kda", "fla", lambda t: _fla("kda", "chunk_kda")(
                t["q"], t["k"], t["v"], t["g"], t["beta"], scale=scale, use_qk_l2norm_in_kernel=True)[0])]
        return []
    if delta or l2 or spec.normalize == "sum":
        return []
    def simple_gla(gate: str):
        """chunk_simple_gla with our g as its per-token gate (g) or per-head one (g_gamma)."""
        return lambda t: _fla("simple_gla", "chunk_simple_gla")(t["q"], t["k"], t["v"], scale=scale,
                                                                **{gate: t["g"]})[0]
    return {
        "scalar": [Baseline("fla chunk_simple_gla", "fla", simple_gla("g"))],
        "constant": [Baseline("fla chunk_simple_gla g_gamma", "fla", simple_gla("g_gamma"))],
        "vector": [Baseline("fla chunk_gla", "fla", lambda t: _fla("gla", "chunk_gla")(
            t["q"], t["k"], t["v"], t["g"], scale=scale)[0])],
        "none": [Baseline("fla chunk_linear_attn", "fla", lambda t: _fla("linear_attn", "chunk_linear_attn")(
            t["q"], t["k"], t["v"], scale=scale, normalize=False)[0])],
    }[decay]


def _softmax_baselines(spec: Spec, shape: Shape, scale: float, device) -> list[Baseline]:
    Tq, Tk = shape.q_len, shape.k_len or shape.q_len
    gqa = bool(shape.kv_heads and shape.kv_heads != shape.heads)
    heads_first = lambda x: x.transpose(1, 2)  # noqa: E731
    out = []
    # SDPA: no mask, or the causal one where it is the end-aligned one (Tq == Tk; Tq = 1 sees every key)
    if spec.decay == "none" and (spec.mask == "bidirectional" or (spec.mask == "causal" and (Tq == Tk or Tq == 1))):
        causal = spec.mask == "causal" and Tq > 1
        out.append(Baseline(f"SDPA{' causal' if causal else ''}", "sdpa", lambda t: heads_first(
            F.scaled_dot_product_attention(*(heads_first(t[n]) for n in "qkv"), is_causal=causal, scale=scale,
                                           **({"enable_gqa": True} if gqa else {})))))
    off, window = Tk - Tq, spec.window
    # fla's forgetting attention: log forget gates g [B, T, H], causal or a window, queries and keys alike
    if spec.decay == "scalar" and spec.mask in ("causal", "sliding_window") and Tq == Tk:
        def fla_forgetting(t):
            from fla.ops.forgetting_attn import parallel_forgetting_attn
            return parallel_forgetting_attn(t["q"], t["k"], t["v"], t["g"], scale=scale,
                                            window_size=window if spec.mask == "sliding_window" else None)
        out.append(Baseline("fla parallel_forgetting_attn", "fla", fla_forgetting))

    def block_mask():
        from torch.nn.attention.flex_attention import create_block_mask
        if spec.mask == "bidirectional":
            return None
        if spec.mask == "causal":
            return create_block_mask(lambda b, h, q, kv: q + off >= kv, None, None, Tq, Tk, device=device)
        return create_block_mask(lambda b, h, q, kv: (q + off >= kv) & (q + off - kv < window), None, None, Tq, Tk,
                                 device=device)

    state: dict = {}

    def flex(t):
        if not state:   # built on the first call: the block mask once per case
            state.update(mask=block_mask(), attend=_compiled_flex())
        score_mod = _decay_score_mod(t["g"], off) if spec.decay == "scalar" else None
        return heads_first(state["attend"](*(heads_first(t[n]) for n in "qkv"), score_mod=score_mod,
                                           block_mask=state["mask"], scale=scale, enable_gqa=gqa))
    name = {"causal": "causal", "sliding_window": f"window {window}", "bidirectional": "no mask"}[spec.mask]
    out.append(Baseline(f"FlexAttention {name}{' + decay score_mod' if spec.decay == 'scalar' else ''}", "flex", flex))
    return out


def _decay_score_mod(g: torch.Tensor, off: int):
    """FlexAttention's score_mod of the forgetting decay: the bias sum_{i=j+1..t} g_i = G_t - G_j of
    G the cumulative floored log decay, g [B, Tk, H], queries aligned to the end of the keys."""
    G = torch.cumsum(g.float().clamp(min=LOG_DECAY_FLOOR), 1).transpose(1, 2)   # [B, H, Tk]
    # two tensors, each indexed once: FlexAttention's backward does not take a score_mod indexing
    # one tensor that requires gradients twice (its gradient reaches g through both)
    G_q, G_k = G.clone(), G.clone()

    def score_mod(score, b, h, q, kv):
        return score + G_q[b, h, q + off] - G_k[b, h, kv]
    return score_mod


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention)


def baselines(spec: Spec, shape: Shape, scale: float, device, wanted: tuple[str, ...] = BASELINES) -> list[Baseline]:
    """The baselines of the spec's semantics among `wanted` (fla, sdpa, flex)."""
    found = _linear_baselines(spec, scale) if spec.is_linear else _softmax_baselines(spec, shape, scale, device)
    return [b for b in found if b.source in wanted]


def missing_package(source: str) -> str | None:
    """Why a baseline's package cannot run here, or None."""
    if source == "fla":
        try:
            import fla  # noqa: F401
        except ImportError as e:
            return f"flash-linear-attention is not installed ({e}; pip install flash-linear-attention)"
    if source == "flex":
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError as e:
            return f"this torch has no FlexAttention ({e})"
    return None


def fla_backward_guard(report) -> None:
    """fla refuses its gated backward on Hopper with Triton < 3.7.1 (fla issue #640: wrong dβ/dg
    there). Its time is still the baseline's time: the guard is turned off for timing; only outputs
    are compared, never its gradients."""
    try:
        import fla.ops.common.chunk_o as fla_chunk_o
    except ImportError:
        return
    if not getattr(fla_chunk_o, "TRITON_ABOVE_3_7_1", True):
        fla_chunk_o.TRITON_ABOVE_3_7_1 = True
        report("fla: gated backward timed with its Triton < 3.7.1 guard off (gradients not compared)")


# ---------------------------------------------------------------------------- measures
def flops(spec: Spec, shape: Shape, bwd: bool) -> float:
    """Floating-point operations of the computation (the same for attngen and the baseline).
    Softmax: 2 (K + V) per allowed (query, key) pair (scores and values; fwd+bwd 3.5x, the
    recomputed scores and four more products). Linear: the recurrence's, per token and head 2 F V
    for the state update and 2 F V for the readout (the delta rule 2 F V more for S^T k; fwd+bwd 3x)."""
    B, Tq, H, K, V = shape.batch, shape.q_len, shape.heads, shape.head_dim, shape.value_dim
    if not spec.is_linear:
        Tk = shape.k_len or Tq
        if spec.mask == "bidirectional":
            pairs = Tq * Tk
        else:
            width = Tk if spec.mask == "causal" else spec.window
            # query t (0-based) sees keys up to t + Tk - Tq, at most `width` of them
            pairs = sum(min(width, t + Tk - Tq + 1) for t in range(Tq))
        fwd = 2.0 * pairs * (K + V) * B * H
        return fwd * (3.5 if bwd else 1.0)
    Fd = spec.feature_dim(K)
    fwd = spec.rule.state_flops * Fd * V * B * Tq * H
    return fwd * (3.0 if bwd else 1.0)


def io_bytes(inputs: dict, out: torch.Tensor, bwd: bool) -> int:
    """Bytes a pass must move at least: the inputs read and the output written (fwd+bwd: also the
    inputs read again, the output's gradient read and the inputs' gradients written)."""
    ins = sum(t.numel() * t.element_size() for t in inputs.values() if isinstance(t, torch.Tensor))
    o = out.numel() * out.element_size()
    return 3 * ins + 2 * o if bwd else ins + o


@functools.lru_cache(maxsize=None)
def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy of 512 MiB (read + write): the floor's speed."""
    import triton
    src = torch.empty(1 << 29, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def do_bench_timer(bwd: bool) -> Callable[[Callable[[], object]], float]:
    import triton
    warmup, rep = (10, 50) if bwd else (25, 100)
    return lambda fn: triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def wall_timer(fn: Callable[[], object], reps: int = 3) -> float:
    """Median wall-clock milliseconds of fn (the CPU: Triton's interpreter has no GPU timer)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def step(fn: Callable[[], torch.Tensor], bwd: bool, inputs: dict) -> Callable[[], object]:
    """fn itself, or (bwd) a forward + backward step of it with a fixed output gradient, clearing
    the inputs' .grad after each."""
    if not bwd:
        return fn
    grad = torch.randn_like(fn())
    leaves = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]

    def run():
        fn().backward(grad)
        for t in leaves:
            t.grad = None
    return run


def profile(run: Callable[[], object], reps: int = 5) -> list[tuple[str, float]]:
    """[(kernel name, microseconds per call)] of run's GPU kernels, slowest first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    run()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / reps) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


@dataclasses.dataclass(frozen=True)
class Row:
    spec: str
    shape: str
    pass_: str                  # fwd | fwd+bwd
    impl: str                   # attngen, or the baseline's name
    ms: float | None
    ratio: float | None         # attngen's time over this row's
    tflops: float | None
    floor: float | None         # the memory floor's time over this row's (1: at the floor)
    peak_mib: float | None      # peak memory allocated during one call, beyond the inputs
    rel_diff: float | None      # baseline rows: its output against attngen's
    first_s: float | None = None    # attngen rows: the first call, compilation included
    note: str = ""


def _measure(fn, bwd, inputs, timer, cuda) -> tuple[float, float | None]:
    """(milliseconds, peak MiB) of fn (a forward, or a forward + backward step with bwd)."""
    run = step(fn, bwd, inputs)
    peak = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    return timer(run), peak


def bench_case(spec: Spec, shape: Shape, dtype: torch.dtype, device, bwd: bool, wanted: tuple[str, ...],
               timer: Callable | None = None, report=print, profile_kernels: bool = False) -> list[Row]:
    """attngen and the baselines of a spec at one shape: one Row each, each reported (format_row)
    as it is measured."""
    from . import runtime
    from .testing import rel_error
    cuda = torch.device(device).type == "cuda"
    timer = timer or (do_bench_timer(bwd) if cuda else wall_timer)
    pass_, label = ("fwd+bwd" if bwd else "fwd"), format_shape(shape)
    rows = []

    def add(row: Row) -> list[Row]:
        report(format_row(row))
        rows.append(row)
        return rows

    if spec.is_linear and (shape.k_len or shape.kv_heads):
        return add(Row(spec.name, label, pass_, "attngen", None, None, None, None, None, None,
                       note="skipped: Tq and H_kv are for softmax specs"))
    op = runtime.load(spec)
    inputs = bench_inputs(spec, shape, dtype, device, requires_grad=bwd)
    call = runtime.check_call(op, inputs)
    ours = (lambda: op(**inputs)[0]) if spec.is_linear else (lambda: op(**inputs))
    work = flops(spec, shape, bwd)
    start = time.time()
    try:
        # the first call (with --bwd its backward too): compilation included
        o = ours()
        if bwd:
            o.backward(torch.ones_like(o))
            for t in inputs.values():
                t.grad = None
        if cuda:
            torch.cuda.synchronize()
        first = time.time() - start
        ms, peak = _measure(ours, bwd, inputs, timer, cuda)
    except Exception as e:  # noqa: BLE001 -- a failing case is a row saying why; the others still run
        return add(Row(spec.name, label, pass_, "attngen", None, None, None, None, None, None,
                       note=f"failed: {type(e).__name__}: {str(e)[:160]}"))
    floor_ms = io_bytes(inputs, o, bwd) / copy_bandwidth(str(device)) * 1e3 if cuda else None
    row = lambda impl, t, **kw: Row(spec.name, label, pass_, impl, t, ms / t, work / t / 1e9,  # noqa: E731
                                    floor_ms / t if floor_ms else None, **kw)
    add(row("attngen", ms, peak_mib=peak, rel_diff=None, first_s=first))

    def report_kernels(fn) -> None:
        # --profile: the implementation's slowest GPU kernels under its row
        if profile_kernels and cuda:
            for kernel, us in profile(step(fn, bwd, inputs))[:8]:
                report(f"    {us:9.1f} us  {kernel[:90]}")
    report_kernels(ours)
    for base in baselines(spec, shape, call.scale, device, wanted):
        why = missing_package(base.source)
        if why:
            add(Row(spec.name, label, pass_, base.name, None, None, None, None, None, None, note=why))
            continue
        try:
            diff = rel_error(base.fn(inputs).detach().float(), o.detach().float())
            t, peak = _measure(lambda: base.fn(inputs), bwd, inputs, timer, cuda)  # noqa: B023
        except Exception as e:  # noqa: BLE001 -- a baseline may refuse a case: said in its row
            add(Row(spec.name, label, pass_, base.name, None, None, None, None, None, None,
                    note=f"failed: {type(e).__name__}: {str(e)[:160]}"))
            continue
        add(row(base.name, t, peak_mib=peak, rel_diff=diff))
        report_kernels(lambda: base.fn(inputs))  # noqa: B023
    return rows


HEADER = (f"{'spec':<22s} {'shape':<22s} {'pass':<7s} {'implementation':<42s} {'ms':>9s} {'ratio':>6s} "
          f"{'TFLOP/s':>8s} {'floor':>6s} {'peak MiB':>9s} {'rel diff':>9s}  note")


def format_row(r: Row) -> str:
    num = lambda x, f, w: format(x, f).rjust(w) if x is not None else "-".rjust(w)  # noqa: E731
    note = r.note or (f"first call {r.first_s:.1f} s" if r.first_s is not None else "")
    return (f"{r.spec:<22s} {r.shape:<22s} {r.pass_:<7s} {r.impl:<42s} {num(r.ms, '.3f', 9)} {num(r.ratio, '.2f', 6)} "
            f"{num(r.tflops, '.1f', 8)} {num(r.floor, '.2f', 6)} {num(r.peak_mib, '.0f', 9)} "
            f"{num(r.rel_diff, '.1e', 9)}  {note}")


def plot(rows: list[Row], path: str) -> None:
    """Time against the keys' length, one line per spec and implementation (log-log)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    lines: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
    for r in rows:
        if r.ms is not None:
            lines.setdefault((r.spec, r.impl, r.pass_), []).append((int(r.shape.split(",")[1]), r.ms))
    for (spec, impl, pass_), points in sorted(lines.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{spec}: {impl} ({pass_})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("time (ms)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def sweep(shape: Shape) -> list[Shape]:
    """--plot with one shape: the keys' length T from 1K to 128K at the shape's tokens per batch
    (B T, B at least 1); the queries follow T unless the shape gives their number (decode)."""
    tokens = shape.batch * (shape.k_len or shape.q_len)
    return [dataclasses.replace(shape, batch=max(1, tokens // T), q_len=T if shape.k_len is None else shape.q_len,
                                k_len=None if shape.k_len is None else T) for T in SEQ_SWEEP]


def run(specs: list[Spec], shapes: list[Shape], dtype: torch.dtype, device, bwd_passes: tuple[bool, ...],
        wanted: tuple[str, ...], timer: Callable | None = None, report=print,
        profile_kernels: bool = False) -> list[Row]:
    """Every spec at every shape and pass, rows printed as they come."""
    if True in bwd_passes and "fla" in wanted:
        fla_backward_guard(report)
    sources = {b.source for spec in specs for shape in shapes for b in
               baselines(spec, shape, 1.0, device, wanted)}
    for source in sorted(sources):
        why = missing_package(source)
        if why:
            report(f"{source} baselines skipped: {why}")
    report(HEADER)
    rows = []
    for bwd in bwd_passes:
        for spec in specs:
            for shape in shapes:
                rows += bench_case(spec, shape, dtype, device, bwd, wanted, timer, report, profile_kernels)
    return rows


def no_device_reason() -> str | None:
    """Why attngen bench cannot time kernels here, or None: a CUDA GPU, or Triton's interpreter
    (TRITON_INTERPRET=1 with ATTNGEN_BACKEND=triton: tiny shapes, wall-clock times)."""
    import os
    if torch.cuda.is_available():
        return None
    if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("ATTNGEN_BACKEND") == "triton":
        return None
    return ("no CUDA GPU here (torch.cuda.is_available() is False): benchmarks time the kernels on a GPU "
            "(Triton's interpreter runs them on the CPU with TRITON_INTERPRET=1 ATTNGEN_BACKEND=triton, "
            "tiny shapes only)")


def check_plot_support() -> str | None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib (pip install 'attngen[plot]')"
    return None
