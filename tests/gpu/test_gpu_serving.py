"""Serving on the GPU (compiled mode): a prompt prefilled through the StateCache and decoded token
by token with a prepared step equals one forward over the whole sequence; a decode step captured
in a CUDA graph and replayed equals eager decode (linear and softmax); an eager step makes no host sync.

Run on a CUDA machine: bash gpu.sh tests/gpu/<this file>
"""
from pathlib import Path

import pytest
import torch

import attngen
from attngen.testing import Shape, random_inputs, rel_error

ROOT = Path(__file__).resolve().parents[2]
SERVED = ["deltanet", "gated_deltanet", "gla", "kda", "linear_transformer", "mamba2", "performer", "retnet"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
B, T, PREFILL, H, D = 3, 40, 29, 4, 64


def _inputs(op, dtype, seed=0):
    x = random_inputs(op.spec, Shape(B, T, H, D, D), seed=seed, initial_state=False)
    return {n: (t.to(dtype) if n in ("q", "k", "v") else t.float()).cuda() for n, t in x.items()}


def _tokens(x, start, end):
    return {n: (t[:, start:end].contiguous() if t.dim() > 1 else t) for n, t in x.items()}


@pytest.mark.parametrize("name", SERVED)
@pytest.mark.parametrize("dname", DTYPES)
def test_prefill_and_decode_equal_one_forward(name, dname):
    op = attngen.load(ROOT / "specs" / f"{name}.yaml")
    dtype = DTYPES[dname]
    x = _inputs(op, dtype)
    o_ref, s_ref = op(**x, output_final_state=True)
    cache = attngen.StateCache(op, slots=7, heads=H, head_dim=D, value_dim=D, device="cuda")
    slots = torch.tensor([6, 0, 3], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        o, _ = op(**_tokens(x, 0, PREFILL), cache=cache, slots=slots)
        outs = [o]
        step = op.prepare_decode(cache, B, dtype=dtype)
        for t in range(PREFILL, T):
            outs.append(step(**_tokens(x, t, t + 1), slots=slots).clone())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_error(torch.cat(outs, 1), o_ref) < tol
    assert rel_error(cache.state[slots.long()], s_ref) < tol


@pytest.mark.parametrize("name", ["gated_deltanet", "linear_transformer"])
def test_graph_replay_equals_eager(name):
    """Decode steps captured once in a CUDA graph, replayed on new inputs copied into the captured
    buffers (padding row included), equal the eager steps from the same cache; eager steps make
    no host sync (torch's sync debug mode raises on one)."""
    op = attngen.load(ROOT / "specs" / f"{name}.yaml")
    x = _inputs(op, torch.bfloat16)
    eager = attngen.StateCache(op, slots=5, heads=H, head_dim=D, value_dim=D, device="cuda")
    graphed = attngen.StateCache(op, slots=5, heads=H, head_dim=D, value_dim=D, device="cuda")
    slots = torch.tensor([4, -1, 1], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        step_e = op.prepare_decode(eager, B, dtype=torch.bfloat16)
        step_g = op.prepare_decode(graphed, B, dtype=torch.bfloat16)
        static = _tokens(x, 0, 1)
        static_slots = slots.clone()
        step_g(**static, slots=static_slots)  # compiles the kernel before the capture
        graphed.state.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step_g(**static, slots=static_slots)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for t in range(6):
                want = step_e(**_tokens(x, t, t + 1), slots=slots)
                for n, buf in static.items():
                    buf.copy_(_tokens(x, t, t + 1)[n])
                graph.replay()
                torch.cuda.set_sync_debug_mode("default")
                assert rel_error(out, want) < 1e-6, t
                torch.cuda.set_sync_debug_mode("error")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert rel_error(graphed.state, eager.state) < 1e-6
    assert graphed.state[[0, 2, 3]].abs().max() == 0


@pytest.mark.parametrize("name", ["softmax_causal", "sliding_window"])
def test_softmax_graph_replay_equals_eager(name):
    """A softmax decode step (its keys split across programs, whose last to finish merges the partials
    and sets the count back for the next step) captured once in a CUDA graph and replayed on new
    tokens equals the eager steps on a twin cache, step by step; the caches end equal."""
    op = attngen.load(ROOT / "specs" / f"{name}.yaml")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = dict(max_piece=1) if op.spec.mask == "sliding_window" else dict(max_len=4096)
    caches = [attngen.StateCache(op, slots=5, heads=2, head_dim=D, value_dim=D, device="cuda", dtype=torch.bfloat16,
                                 **rows) for _ in range(2)]
    for cache in caches:
        cache.k.copy_(torch.randn(cache.k.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda"))
        cache.v.copy_(torch.randn(cache.v.shape, generator=torch.Generator(device="cuda").manual_seed(2), device="cuda"))
        cache.lengths.copy_(torch.tensor([3000, 0, 2047, 0, 3900], dtype=torch.int32))
    slots = torch.tensor([4, -1, 2], dtype=torch.int32, device="cuda")

    def token():
        return {"q": torch.randn(B, 1, H, D, generator=gen, device="cuda", dtype=torch.bfloat16),
                "k": torch.randn(B, 1, 2, D, generator=gen, device="cuda", dtype=torch.bfloat16),
                "v": torch.randn(B, 1, 2, D, generator=gen, device="cuda", dtype=torch.bfloat16)}
    with torch.no_grad():
        step_e = op.prepare_decode(caches[0], B, dtype=torch.bfloat16, heads=H)
        step_g = op.prepare_decode(caches[1], B, dtype=torch.bfloat16, heads=H)
        static, static_slots = token(), slots.clone()
        warm = attngen.StateCache(op, slots=5, heads=2, head_dim=D, value_dim=D, device="cuda", dtype=torch.bfloat16,
                                  **rows)
        op.prepare_decode(warm, B, dtype=torch.bfloat16, heads=H)(**static, slots=static_slots)  # compiles first
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step_g(**static, slots=static_slots)
        for t in range(5):
            x = token()
            want = step_e(**x, slots=slots)
            for n, buf in static.items():
                buf.copy_(x[n])
            graph.replay()
            assert rel_error(out[[0, 2]], want[[0, 2]]) < 1e-6, t
    assert caches[0].lengths.tolist() == caches[1].lengths.tolist()
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


@pytest.mark.parametrize("name", ["softmax_causal", "sliding_window", "window_ring", "forgetting_attention",
                                  "window_ring_decay"])
@pytest.mark.parametrize("dname", DTYPES)
def test_softmax_prefill_and_decode_equal_one_forward(name, dname):
    """Keys and values through the cache (grouped-query heads; window_ring's 96 rows wrap and its
    decode queries split their keys across programs; with decay, the cache keeps each key's
    cumulative log decay) equal attention over the whole sequence."""
    ring = name.startswith("window_ring")
    decay = dict(decay="scalar") if name.endswith("decay") else {}
    spec = dict(name=name, attention="softmax", mask="sliding_window", window=64, **decay) \
        if ring else ROOT / "specs" / f"{name}.yaml"
    op = attngen.load(spec)
    dtype, T_long = DTYPES[dname], 300
    x = random_inputs(op.spec, Shape(B, T_long, H, D, D, kv_heads=2), seed=1)
    x = {n: t.to(dtype).cuda() for n, t in x.items()}
    want = op(**x)
    rows = dict(max_piece=33) if ring else dict(max_len=T_long)
    if op.spec.decay == "scalar":
        rows["query_heads"] = H
    cache = attngen.StateCache(op, slots=7, heads=2, head_dim=D, value_dim=D, device="cuda", dtype=dtype, **rows)
    slots = torch.tensor([6, 0, 3], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        outs = [op(**_tokens(x, a, a + 30), cache=cache, slots=slots) for a in range(0, 270, 30)]
        step = op.prepare_decode(cache, B, dtype=dtype, heads=H)
        outs += [step(**_tokens(x, t, t + 1), slots=slots).clone() for t in range(270, T_long)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_error(torch.cat(outs, 1), want) < tol
