"""The chunked backward kernels (and the parallel form's, which runs as one chunk of them) of
additive and delta rules against the float64 interpreter: gradients of q, k, v, g, beta and the
initial state under a loss on the output and the final state, through Triton's interpreter on the
CPU (DESIGN.md §7). Every check also asserts that the generated backward ran, not the PyTorch
recompute."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attngen
from attngen import codegen, kernel_lib, planner, tuning
from attngen.reference import reference
from attngen.testing import (FLOAT64_RTOL, Shape, compare, kernel_launch, random_inputs, rel_error, spy_launches,
                             vector_gates_across_span)

import specs
from strategies import STRICTLY_POSITIVE_MAPS, causal_linear, legal_specs


pytestmark = pytest.mark.usefixtures("triton_backend")

SPECS = specs.causal_linear("chunked_bwd")


@pytest.fixture
def kernel_backward(monkeypatch):
    """load(spec) -> (op, calls): the op, and a list that records each run of its module's
    chunked_bwd (wrapped: module.backward looks it up by name)."""
    def load(spec: dict):
        op = attngen.load(spec)
        module = codegen.load_module(op.spec)
        calls = []
        inner = module.chunked_bwd

        def counted(*args, **kwargs):
            calls.append(args[9])  # the chunk size
            return inner(*args, **kwargs)

        monkeypatch.setattr(module, "chunked_bwd", counted)
        return op, calls
    return load


def check(kernel_backward, spec: dict, shape: Shape, dtype=torch.float32, form: str = "chunked",
          chunk: int | None = 16, initial_state: bool = True, seed: int = 0, decay_strength: float = 1.0) -> None:
    op, calls = kernel_backward(spec)
    inputs = random_inputs(op.spec, shape, seed=seed, initial_state=initial_state, decay_strength=decay_strength)
    fn = lambda **kw: op(**kw, form=form, chunk_size=chunk if form == "chunked" else None)
    rows = compare(op.spec, fn, inputs, dtype, with_grads=True)
    where = f"{spec['name']} {form}(chunk={chunk}) {dtype} on {shape}"
    assert calls, f"{where}: the generated chunked backward did not run"
    failures = [f"{n}: error {e:.3g} > tolerance {t:.3g}" for n, e, t in rows if not e <= t]
    assert not failures, f"{where}:\n" + "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SPECS))
def test_grads_match_interpreter(kernel_backward, name, dtype):
    """Every additive spec: several chunks with a partial last one, K != V, two sequences."""
    check(kernel_backward, SPECS[name], Shape(batch=2, q_len=37, heads=1, head_dim=8, value_dim=12), dtype)


@pytest.mark.parametrize("T, chunk", [(1, 16), (7, 32), (63, 64), (100, 16), (100, 64)])
@pytest.mark.parametrize("name", ["linear_transformer", "mamba2", "retnet", "gated_deltanet"])
def test_lengths_and_chunk_sizes(kernel_backward, name, T, chunk):
    check(kernel_backward, SPECS[name], Shape(batch=1, q_len=T, heads=2, head_dim=8, value_dim=6),
          chunk=chunk, seed=T)


@pytest.mark.parametrize("name", ["mamba2", "retnet"])
def test_bf16_backward_at_64_token_chunks(kernel_backward, name):
    """bf16 Mamba2 and RetNet take a backward of 64-token chunks (planner.chunked_launch), the other
    rules' 32: two chunks with a partial last one, two sequences."""
    shape = Shape(batch=2, q_len=100, heads=2, head_dim=8, value_dim=6)
    op = attngen.load(SPECS[name])
    inputs = {n: (t.bfloat16() if n in ("q", "k", "v") else t) for n, t in random_inputs(op.spec, shape).items()}
    assert planner.ChunkedLaunch(*kernel_launch(op, inputs, "chunked", 64)[1]).bwd_chunk == 64
    check(kernel_backward, SPECS[name], shape, torch.bfloat16, chunk=64, seed=5)


@pytest.mark.parametrize("T", [7, 63])
@pytest.mark.parametrize("name", ["performer", "retnet", "gla", "gated_deltanet"])
def test_parallel_form(kernel_backward, name, T):
    """The parallel form's gradients: one chunk of 16, 32 or 64 tokens spanning the sequence."""
    check(kernel_backward, SPECS[name], Shape(batch=1, q_len=T, heads=2, head_dim=8, value_dim=6),
          form="parallel", chunk=None, seed=T)


@pytest.mark.parametrize("K, V", [(20, 5), (72, 40)])
@pytest.mark.parametrize("name", ["linear_transformer", "retnet", "expr_map", "gated_deltanet"])
def test_head_dims(kernel_backward, name, K, V):
    """K not a power of two, K > V, and F > 64 (two value blocks of 32: the shares of dq, dk,
    the normalizer's column and the decay gradient are summed over value blocks)."""
    check(kernel_backward, SPECS[name], Shape(batch=1, q_len=21, heads=1, head_dim=K, value_dim=V), seed=K)


@pytest.mark.parametrize("name, initial_state", [
    (name, h0) for name in ("linear_transformer", "performer", "mamba2", "retnet", "gated_deltanet") for h0 in (True, False)
] + [("gla", True), ("kda", True)])
def test_varlen(kernel_backward, name, initial_state):
    """Packed sequences, one of length 1, each its own chunks, initial state and gradients."""
    shape = Shape(batch=1, q_len=57, heads=2, head_dim=8, value_dim=6, cu_seqlens=(0, 1, 18, 50, 57))
    check(kernel_backward, SPECS[name], shape, initial_state=initial_state)


@pytest.mark.parametrize("name, seed", [("mamba2", 0), ("mamba2", 3), ("retnet", 3), ("retnet", 4),
                                        ("gla", 1), ("expr_map", 0), ("gated_deltanet", 3), ("kda", 2)])
def test_strong_decay(kernel_backward, name, seed):
    """g down to about -20 per token, 64-token chunks: the decay gradient stays as accurate as
    plain float32 PyTorch (its pairs s = t and the cross-chunk sums would otherwise cancel)."""
    check(kernel_backward, SPECS[name], Shape(batch=1, q_len=100, heads=2, head_dim=8, value_dim=6),
          chunk=64, seed=seed, decay_strength=20)


def mixed_vector_gates(shape: Shape, seed: int) -> torch.Tensor:
    """Vector log decays g [B, T, H, K]: per feature lane, gates near 0 (-1e-3 .. 0), gates down to
    -50 per token, or a mix of both token by token. Over a 64-token chunk a strong lane's cumulative
    log decay reaches about -1600: exp(-G) overflows float32 beyond -88."""
    gen = torch.Generator().manual_seed(seed)
    size = (shape.batch, shape.q_len, shape.heads, shape.head_dim)
    strong_share = torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64).repeat(shape.head_dim)[:shape.head_dim]
    strong = torch.rand(size, generator=gen, dtype=torch.float64) < strong_share
    depth = torch.rand(size, generator=gen, dtype=torch.float64)
    return torch.where(strong, -50.0 * depth, -1e-3 * depth)


# 16-token chunks in both dtypes; 32 in bf16, 64 in fp32
@pytest.mark.parametrize("dtype, chunk", [(torch.float32, 16), (torch.bfloat16, 16), (torch.bfloat16, 32),
                                          (torch.float32, 64)], ids=["fp32-16", "bf16-16", "bf16-32", "fp32-64"])
@pytest.mark.parametrize("name", ["gla", "kda"])
def test_strong_vector_decay(kernel_backward, name, dtype, chunk):
    """Vector decays mixing near-0 and very strong gates (down to -50 per token), T not a multiple of
    the chunk: outputs, final state and every gradient finite (rel_error is inf otherwise) and
    within tolerance of the oracle, at chunks of 16, 32 and 64 tokens (the backward's at most 32)."""
    op, calls = kernel_backward(SPECS[name])
    shape = Shape(batch=1, q_len=100, heads=2, head_dim=12, value_dim=6)
    inputs = random_inputs(op.spec, shape, seed=chunk)
    inputs["g"] = mixed_vector_gates(shape, seed=chunk)
    assert float(inputs["g"].min()) < -45 and float(inputs["g"].max()) > -1e-4
    rows = compare(op.spec, lambda **kw: op(**kw, form="chunked", chunk_size=chunk), inputs, dtype)
    assert calls
    failures = [f"{n}: error {e:.3g} > tolerance {t:.3g}" for n, e, t in rows if not e <= t]
    assert not failures, f"{name} chunk {chunk} {dtype}:\n" + "\n".join(failures)


def span_edge_vector_gates(shape: Shape, seed: int) -> torch.Tensor:
    """Vector log decays g [B, T, H, K] whose 16-token blocks fall on both sides of
    planner.DECAY_SPAN: in even 32-token stretches a third of the lanes decay by DECAY_SPAN / 16
    times 0.95 .. 0.99 per token (a block spans just inside, its pairs' factors exp(-G) near
    exp(DECAY_SPAN)), in odd stretches by down to -50 (far past it); the other lanes near 0."""
    gen = torch.Generator().manual_seed(seed)
    size = (shape.batch, shape.q_len, shape.heads, shape.head_dim)
    lane = (torch.arange(shape.head_dim) % 3 == 1).expand(size)
    odd = (torch.arange(shape.q_len) // 32 % 2 == 1)[None, :, None, None].expand(size)
    depth = torch.rand(size, generator=gen, dtype=torch.float64)
    edge = -planner.DECAY_SPAN / 16 * (0.95 + 0.04 * depth)
    return torch.where(lane, torch.where(odd, -50.0 * depth, edge), -1e-3 * depth)


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["gla", "kda"])
def test_vector_decay_both_sides_of_the_span(kernel_backward, name, dtype, chunk):
    """Chunks whose blocks' decay spans just inside planner.DECAY_SPAN (the pairs inside a block as
    one dot through exp(-G) up to about exp(DECAY_SPAN)) and chunks far past it (by offsets) in one
    sequence: every gradient within tolerance of the oracle."""
    op, calls = kernel_backward(SPECS[name])
    shape = Shape(batch=1, q_len=100, heads=2, head_dim=12, value_dim=6)
    inputs = random_inputs(op.spec, shape, seed=chunk)
    inputs["g"] = span_edge_vector_gates(shape, seed=chunk)
    # [6] the widest span of each whole 16-token block over heads and lanes
    block_span = inputs["g"][:, :96].unflatten(1, (6, 16)).sum(2).amin((0, 2, 3)).neg()
    assert block_span[[0, 1, 4, 5]].max() < planner.DECAY_SPAN < block_span[[2, 3]].min()
    assert block_span[[0, 1, 4, 5]].min() > 0.9 * planner.DECAY_SPAN
    rows = compare(op.spec, lambda **kw: op(**kw, form="chunked", chunk_size=chunk), inputs, dtype)
    assert calls
    failures = [f"{n}: error {e:.3g} > tolerance {t:.3g}" for n, e, t in rows if not e <= t]
    assert not failures, f"{name} chunk {chunk} {dtype}:\n" + "\n".join(failures)


@pytest.mark.parametrize("name, dtype", [("gla", torch.float32), ("gla", torch.bfloat16), ("kda", torch.float32),
                                         ("gla_sum", torch.float32)], ids=["gla-fp32", "gla-bf16", "kda-fp32", "gla_sum-fp32"])
def test_vector_decay_both_sides_of_the_chunk_span(kernel_backward, name, dtype):
    """64-token chunks whose decay spans just inside planner.DECAY_SPAN (the output pass takes the
    chunk's pairs in one dot), past it with 16-token blocks inside (by blocks, each one dot) and far
    past it (by offsets) in one sequence: outputs, final state and every gradient within tolerance."""
    op, calls = kernel_backward(SPECS[name])
    shape = Shape(batch=1, q_len=200, heads=2, head_dim=12, value_dim=6)
    inputs = random_inputs(op.spec, shape, seed=7)
    inputs["g"] = vector_gates_across_span(shape, seed=7)
    # [3] the widest span of each whole 64-token chunk, and of chunk 1's 16-token blocks
    chunk_span = inputs["g"][:, :192].unflatten(1, (3, 64)).sum(2).amin((0, 2, 3)).neg()
    block_span = inputs["g"][:, 64:128].unflatten(1, (4, 16)).sum(2).amin((0, 2, 3)).neg()
    assert 0.9 * planner.DECAY_SPAN < chunk_span[0] < planner.DECAY_SPAN < chunk_span[1] < chunk_span[2]
    assert block_span.max() < planner.DECAY_SPAN
    rows = compare(op.spec, lambda **kw: op(**kw, form="chunked", chunk_size=64), inputs, dtype)
    assert calls
    failures = [f"{n}: error {e:.3g} > tolerance {t:.3g}" for n, e, t in rows if not e <= t]
    assert not failures, f"{name} {dtype}:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", ["linear_transformer", "performer", "gla_sum"])
def test_normalizer_builds_no_value_copies(kernel_backward, monkeypatch, name):
    """With normalize sum the kernels take the V value columns and carry the ones column as vectors:
    no [v, 1] or [do / n, c] is concatenated (torch.cat fails inside the backward), and the
    gradients still match the interpreter."""
    module = codegen.load_module(attngen.load(SPECS[name]).spec)
    inner = module.chunked_bwd

    def no_cat(*args, **kwargs):
        raise AssertionError("torch.cat in the chunked backward")

    def guarded(*args, **kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(torch, "cat", no_cat)
            return inner(*args, **kwargs)

    monkeypatch.setattr(module, "chunked_bwd", guarded)
    check(kernel_backward, SPECS[name], Shape(batch=2, q_len=37, heads=2, head_dim=8, value_dim=12))


@pytest.mark.parametrize("name", ["linear_transformer", "mamba2", "gla_sum", "gated_deltanet"])
def test_loss_on_output_only(kernel_backward, name):
    """No loss reaches the final state (dht is None): the state gradient starts from zero."""
    op, calls = kernel_backward(SPECS[name])
    inputs = random_inputs(op.spec, Shape(batch=2, q_len=29, heads=1, head_dim=8, value_dim=6))
    inputs["q"], inputs["k"], inputs["v"] = (inputs[n].float() for n in ("q", "k", "v"))
    do = torch.randn(inputs["v"].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = {}
    for label, fn in (("kernel", lambda **kw: op(**kw, form="chunked", chunk_size=16)[0]),
                      ("oracle", lambda **kw: reference(op.spec, **kw)[0])):
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inputs.items()}
        o = fn(**leaves)
        torch.autograd.backward(o, do.to(o.dtype))
        grads[label] = {n: t.grad for n, t in leaves.items()}
    assert calls
    for n, ref in grads["oracle"].items():
        assert rel_error(grads["kernel"][n], ref) < 2e-5, n


@pytest.mark.parametrize("name", ["retnet", "mamba2", "gla", "gated_deltanet"])
def test_decay_gradient_not_asked_for(kernel_backward, monkeypatch, name):
    """A log decay that requires no grad (RetNet's fixed per-head decays, frozen gates): g.grad stays None,
    the other gradients equal those of a call that asks for dg too, and the additive rule's dq and dk
    steps launch without the decay gradient's terms (DG False)."""
    op, calls = kernel_backward(SPECS[name])
    # step 4's kernels: the delta rules' one (planner.fused_dq_dk), or the dq and dk steps
    step4 = (("chunked_bwd_dqk_kernel",) if planner.fused_dq_dk(op.spec)
             else ("chunked_bwd_dq_kernel", "chunked_bwd_dk_kernel"))
    launched = spy_launches(monkeypatch, codegen.load_module(op.spec), step4)
    inputs = random_inputs(op.spec, Shape(batch=2, q_len=37, heads=2, head_dim=16, value_dim=24))
    inputs = {n: (t.float() if t.is_floating_point() else t) for n, t in inputs.items()}
    do = torch.randn(inputs["v"].shape, generator=torch.Generator().manual_seed(1))
    grads = {}
    for asked in (True, False):
        leaves = {n: t.detach().clone().requires_grad_(n != "g" or asked) if t.is_floating_point() else t
                  for n, t in inputs.items()}
        o, _ = op(**leaves, form="chunked", chunk_size=16)
        o.backward(do)
        grads[asked] = {n: t.grad for n, t in leaves.items() if t.is_floating_point()}
    assert len(calls) == 2
    assert grads[True]["g"] is not None and grads[False]["g"] is None
    for n, t in grads[True].items():
        if n != "g":
            assert rel_error(grads[False][n], t) == 0.0, n
    # the additive rule's without the decay gradient's terms; the delta rule's UT step needs them either way
    delta = op.spec.rule.ut_transform
    assert [kw["DG"] for _, _, kw in launched] == [True] * len(step4) + [delta] * len(step4)


@pytest.mark.parametrize("name", ["linear_transformer", "retnet", "gated_deltanet"])
def test_every_gradient_element_written(kernel_backward, name, poison_fresh_buffers):
    """Gradient and scratch buffers allocated NaN-filled (as torch.empty's garbage may be): the
    kernels write every element they read or return, across value blocks, varlen's spare chunk
    slots and a partial last chunk."""
    op, calls = kernel_backward(SPECS[name])

    shape = Shape(batch=1, q_len=41, heads=2, head_dim=72, value_dim=40, cu_seqlens=(0, 1, 23, 41))
    inputs = random_inputs(op.spec, shape)
    inputs = {n: (t.float() if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    assert torch.isnan(torch.empty(3)).all()
    rows = compare(op.spec, lambda **kw: op(**kw, form="chunked", chunk_size=16), inputs, torch.float32)
    assert calls
    failures = [f"{n}: error {e:.3g} > tolerance {t:.3g}" for n, e, t in rows if not e <= t]
    assert not failures, "\n".join(failures)


def test_float64_inputs_run_the_pytorch_forms(kernel_backward):
    """float64 inputs run the PyTorch forms, forward and backward (the kernels compute in
    float32): gradients to the float64 tolerance, and the backward kernel never runs."""
    op, calls = kernel_backward(SPECS["expr_map"])
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=23, heads=1, head_dim=8, value_dim=6))
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inputs.items()}
    o, ht = op(**leaves, output_final_state=True, form="chunked", chunk_size=16)
    (o.sum() + ht.sum()).backward()
    ref = {n: t.detach().clone().requires_grad_(True) for n, t in inputs.items()}
    ref_o, ref_ht = reference(op.spec, **ref, output_final_state=True)
    (ref_o.sum() + ref_ht.sum()).backward()
    assert not calls
    for n, leaf in leaves.items():
        assert leaf.grad.dtype == torch.float64
        assert rel_error(leaf.grad, ref[n].grad) < FLOAT64_RTOL, n


def test_delta_rule_with_constant_decay_keeps_the_pytorch_backward(kernel_backward):
    """A delta rule with a constant decay has no generated chunked backward: the module declares
    none, so the runtime differentiates the PyTorch chunked form (and the gradients are right)."""
    op, calls = kernel_backward(specs.CAUSAL_LINEAR["delta_constant"])
    module = codegen.load_module(op.spec)
    assert "chunked" not in module.BACKWARD_FORMS
    with pytest.raises(ValueError, match="constant"):
        module.chunked_bwd(*[None] * 14)
    calls.clear()
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=20, heads=1, head_dim=8, value_dim=6))
    rows = compare(op.spec, lambda **kw: op(**kw, form="chunked", chunk_size=16), inputs, torch.float32)
    assert not calls
    assert all(e <= t for _, e, t in rows), rows


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(legal_specs(sum_maps=STRICTLY_POSITIVE_MAPS, contractive_delta=True).filter(causal_linear),
       st.sampled_from([Shape(2, 37, 2, 5, 3), Shape(1, 45, 2, 6, 4, cu_seqlens=(0, 1, 20, 45))]), st.booleans())
def test_any_legal_spec_gradients(spec_dict, shape, initial_state):
    """Any legal causal linear spec in the float32 regime of tests/test_forms.py (strictly
    positive maps under the normalizer, unit keys under the delta rule; a constant decay's dg, one
    number per head, is checked in float64 there): every gradient through the chunked kernels."""
    op = attngen.load(spec_dict)
    inputs = random_inputs(op.spec, shape, initial_state=initial_state)
    rows = compare(op.spec, lambda **kw: op(**kw, form="chunked", chunk_size=16), inputs, torch.float32)
    for name, err, tol in rows:
        if name == "dg" and op.spec.decay == "constant":
            continue
        assert err <= tol, f"{name}: rel err {err:.2e} > tol {tol:.2e}"


@pytest.mark.parametrize("name", ["gated_deltanet", "kda", "mamba2", "gla"])
def test_16bit_decay_sums_through_resets(kernel_backward, name):
    """16-bit inputs sum their log decays in float32 (the templates' chunked_decay_dtype), each floored
    at spec.LOG_DECAY_FLOOR32: a chunk whose first 56 tokens reset (g = -inf in the outputs;
    g = -300, below that floor, with the gradients, whose oracle is finite there) and whose last 8
    decay as drawn holds bf16's tolerance in the outputs, final state and every gradient. Floored at
    -1e4 instead, the resets sum to -5.6e5, whose float32 spacing (2^-5) rounds the last tokens'
    factors exp(G_t - G_s): the final states of mamba2 and gla then miss bf16's tolerance."""
    op, calls = kernel_backward(SPECS[name])
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=64, heads=1, head_dim=16, value_dim=16), seed=3)
    fn = lambda **kw: op(**kw, form="chunked", chunk_size=64)  # noqa: E731
    failures = []
    for g_reset, with_grads in ((float("-inf"), False), (-300.0, True)):
        g = inputs["g"].clone()
        g[:, :56] = g_reset
        rows = compare(op.spec, fn, {**inputs, "g": g}, torch.bfloat16, with_grads=with_grads)
        failures += [f"g = {g_reset} {n}: error {e:.3g} > tolerance {t:.3g}" for n, e, t in rows if not e <= t]
    assert calls, "the generated chunked backward did not run"
    assert not failures, "\n".join(failures)



class _Counted:
    """A Triton kernel whose launches (kernel[grid](...)) are counted."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("name, chunk, bwd_chunk, cu_seqlens", [
    ("gated_deltanet", 64, 32, None), ("gated_deltanet", 64, 16, (0, 1, 40, 100, 131)),
    ("deltanet", 32, 32, None), ("kda", 32, 16, (0, 19, 83)), ("kda", 16, 32, None), ("mamba2", 64, 32, None),
])
def test_backward_reads_the_forwards_inverse(monkeypatch, name, chunk, bwd_chunk, cu_seqlens):
    """A differentiated delta-rule forward returns its rows of (I + A)^-1 where the backward's chunk
    divides its own (chunked_keeps_inverse), and the backward then runs no UT step of its own, only
    W, U0 and the keys from their diagonal blocks: its gradients equal those of the backward that
    recomputes the inverse (float32 rounding apart). Elsewhere (the backward's chunk larger, the
    additive rule, a forward not differentiated) the forward keeps nothing."""
    from attngen.signature import LINEAR_OP

    op = attngen.load(SPECS[name])
    module = codegen.load_module(op.spec)
    batch = 1 if cu_seqlens else 2
    T = cu_seqlens[-1] if cu_seqlens else 100
    inputs = random_inputs(op.spec, Shape(batch=batch, q_len=T, heads=2, head_dim=8, value_dim=6, cu_seqlens=cu_seqlens),
                           seed=chunk + bwd_chunk)
    form, ints = kernel_launch(op, inputs, "chunked", chunk)
    launch = dataclasses.replace(planner.ChunkedLaunch(*ints), chunk=chunk, bwd_chunk=bwd_chunk).ints()
    keeps = op.spec.update == "delta" and chunk % bwd_chunk == 0
    ut_calls, wu_calls = [], []
    for kernel, calls in (("chunked_ut_kernel", ut_calls), ("chunked_wu_kernel", wu_calls)):
        if hasattr(module, kernel):  # the delta rules' (the additive rule has neither)
            monkeypatch.setattr(module, kernel, _Counted(getattr(module, kernel), calls))

    def args(for_backward):
        return LINEAR_OP.bind(**{n: inputs.get(n) for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens")},
                              omega=None, scale=0.5, form=form, launch=launch, output_final_state=True,
                              for_backward=for_backward)

    o, ht, saved, starts = module.op(*args(True))
    B, T_, H = inputs["v"].shape[:3]
    assert tuple(saved.shape) == ((B, T_, H, chunk) if keeps else (0,))
    assert module.op(*args(False))[2].numel() == 0
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    dht = torch.randn(ht.shape, generator=torch.Generator().manual_seed(2))
    ut_calls.clear(), wu_calls.clear()
    reused = module.backward(*args(True), o, ht, saved, starts, do, dht)
    if keeps:
        assert (len(ut_calls), len(wu_calls)) == (0, 1)
    else:
        assert len(ut_calls) == (op.spec.update == "delta")
    recomputed = module.backward(*args(True), o, ht, torch.empty(0), starts, do, dht)
    for got, ref in zip(reused, recomputed):
        assert (got is None) == (ref is None)
        if got is not None:
            assert rel_error(got, ref) < 1e-5


@pytest.mark.parametrize("name, chunk, bwd_chunk, segments, reused", [
    ("deltanet", 32, 16, 2, True), ("gated_deltanet", 32, 16, 4, False), ("gated_deltanet", 16, 16, 3, True),
])
def test_backward_starts_from_the_forwards_segments(monkeypatch, name, chunk, bwd_chunk, segments, reused):
    """A differentiated delta-rule forward whose state pass ran by segments returns the states entering
    them (`starts` [N, G - 1, H, F, V] float32, as the op's fake has it) where the backward's segments end
    at the same tokens (256 tokens: 2 segments of 4 chunks of 32 and of 8 of 16; 3 of 6 chunks of 16).
    The backward starts its recomputation from them, walking no segments of its own, with the gradients
    of a backward that walks them (float32 rounding apart; starts of zeros change them). Elsewhere (2
    segments of 128 tokens against 4 of 64) the forward keeps none and the backward walks its own."""
    from attngen.signature import LINEAR_OP

    op = attngen.load(SPECS[name])
    module = codegen.load_module(op.spec)
    inputs = random_inputs(op.spec, Shape(batch=2, q_len=256, heads=2, head_dim=8, value_dim=6), seed=segments)
    form, ints = kernel_launch(op, inputs, "chunked", chunk)
    launch = dataclasses.replace(planner.ChunkedLaunch(*ints), chunk=chunk, bwd_chunk=bwd_chunk,
                                 segments=segments).ints()
    walks, real_walk = [], module.chunked_segment_starts

    def walk(*args, reverse):
        walks.append(reverse)
        return real_walk(*args, reverse=reverse)

    monkeypatch.setattr(module, "chunked_segment_starts", walk)

    def args(for_backward):
        return LINEAR_OP.bind(**{n: inputs.get(n) for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens")},
                              omega=None, scale=0.5, form=form, launch=launch, output_final_state=True,
                              for_backward=for_backward)

    o, ht, saved, starts = module.op(*args(True))
    G = 3 if segments == 3 else 2
    assert tuple(starts.shape) == ((2, G - 1, 2, 8, 6) if reused else (0,)) and starts.dtype == torch.float32
    assert module.chunked_starts_like(inputs["q"], inputs["v"], None, None, form, launch, True).shape == starts.shape
    assert module.op(*args(False))[3].numel() == 0
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    dht = torch.randn(ht.shape, generator=torch.Generator().manual_seed(2))
    walks.clear()
    got = module.backward(*args(True), o, ht, saved, starts, do, dht)
    # the state gradient's walk (reverse), and the states' where the forward kept none
    assert walks == ([True] if reused else [False, True])
    if not reused:
        return
    walked = module.backward(*args(True), o, ht, saved, None, do, dht)
    zeros = module.backward(*args(True), o, ht, saved, torch.zeros_like(starts), do, dht)
    errors = [rel_error(a, b) for a, b in zip(got, walked) if a is not None]
    assert len(errors) >= 5 and max(errors) < 1e-5, errors
    assert max(rel_error(a, b) for a, b in zip(zeros, walked) if a is not None) > 1e-2


@pytest.mark.parametrize("grad", [True, False])
def test_runtime_asks_for_the_inverse_only_when_differentiated(monkeypatch, grad):
    """The runtime's call of the kernel op passes for_backward only when the backward will run the
    kernels (grad mode and an input that requires grad): an inference call keeps no rows of (I + A)^-1."""
    op = attngen.load(SPECS["gated_deltanet"])
    module = codegen.load_module(op.spec)
    seen, real = [], module.forward

    def spy(*args, **kwargs):
        # (the op's forward: the registered op calls it, and an eager call without autograd calls it directly)
        seen.append(args[12])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "forward", spy)
    inputs = {n: t.float() if t is not None and t.is_floating_point() else t
              for n, t in random_inputs(op.spec, Shape(batch=1, q_len=40, heads=1, head_dim=8, value_dim=8)).items()}
    leaves = {n: (t.clone().requires_grad_(grad) if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    with torch.set_grad_enabled(True):
        o, _ = op(**leaves, form="chunked", chunk_size=32)
    with torch.no_grad():
        op(**inputs, form="chunked", chunk_size=32)
    assert seen == [grad, False]
    if grad:
        o.sum().backward()
        assert all(leaves[n].grad is not None for n in ("q", "k", "v"))


# (each split in one dtype: the segments' code is the same in both, the stores' casts are each dtype's)
@pytest.mark.parametrize("min_chunks, segments, dtype", [(1, 7, torch.bfloat16), (3, 2, torch.float32)],
                         ids=["1-7-bf16", "3-2-fp32"])
@pytest.mark.parametrize("name", ["linear_transformer", "performer", "mamba2", "retnet", "gla", "gla_sum"])
def test_state_passes_in_segments(kernel_backward, monkeypatch, name, dtype, min_chunks, segments):
    """The additive rules' state passes (the recomputed chunk-start states and the state gradient)
    by segments of a sequence's chunks (kernel_lib.chunked_state_segments): 7 chunks of 16 in 7
    segments of one (bf16), or 2 of four and three (fp32), two sequences, an initial state; every gradient."""
    monkeypatch.setattr(kernel_lib, "SEGMENT_MIN_CHUNKS", min_chunks)
    assert kernel_lib.chunked_state_segments(2, 100, 16)[0] == segments
    check(kernel_backward, SPECS[name], Shape(batch=2, q_len=100, heads=2, head_dim=8, value_dim=6), dtype,
          seed=min_chunks)


# (each case in one dtype: the segments' code is the same in both, the stores' casts are each dtype's)
DELTA_SEGMENT_CASES = [(7, Shape(batch=2, q_len=100, heads=2, head_dim=8, value_dim=6), None, torch.float32),
                       (2, Shape(batch=1, q_len=100, heads=2, head_dim=40, value_dim=20), 16, torch.bfloat16),
                       (3, Shape(batch=1, q_len=100, heads=1, head_dim=72, value_dim=20), 16, torch.bfloat16)]


@pytest.mark.parametrize("segments, shape, lanes, dtype", DELTA_SEGMENT_CASES,
                         ids=["7x1-fp32", "2x4_lanes16-bf16", "3_keys72-bf16"])
@pytest.mark.parametrize("name", ["gated_deltanet", "deltanet", "kda"])
def test_delta_rules_state_passes_in_segments(kernel_backward, monkeypatch, name, dtype, segments, shape, lanes):
    """The delta rules' state passes (the forward's, the backward's recomputation and the state gradient)
    by segments where the launch asks (launch.segments): a segment's end state is M S + E, M [F, F] the
    product of its chunks' transitions, run from the identity's columns by programs of their own
    (hooks.TransitionSegments). 7 chunks of 16 in 7 segments of one (two sequences, 8 key lanes), or 2
    of four and three at 16 value lanes a program (40 key lanes: M in three column blocks, the last
    partial), or 3 at 72 key lanes (the walk over the segments reads M and the state by blocks of 64
    rows, the second partial); an initial state; outputs, final state and every gradient against the
    interpreter, and each state pass launched over the segments."""
    monkeypatch.setattr(kernel_lib, "SEGMENT_MIN_CHUNKS", 1)
    real = tuning._remembered

    def forced(*args):
        launch = dataclasses.replace(planner.ChunkedLaunch(*real(*args)), segments=segments)
        if lanes:
            launch = dataclasses.replace(launch, states_BV=lanes, bwd_states_BV=lanes)
        return tuple(launch.ints())

    monkeypatch.setattr(tuning, "_remembered", forced)
    grids = []
    op = attngen.load(SPECS[name])
    module = codegen.load_module(op.spec)
    for kernel in ("chunked_states_kernel", "chunked_bwd_states_kernel"):
        real_kernel = getattr(module, kernel)

        class Spy:
            def __getitem__(self, grid, real_kernel=real_kernel, kernel=kernel):
                grids.append((kernel, grid))
                return real_kernel[grid]

        monkeypatch.setattr(module, kernel, Spy())
    check(kernel_backward, SPECS[name], shape, dtype, seed=segments)
    for kernel in ("chunked_states_kernel", "chunked_bwd_states_kernel"):
        # each pass: the ends (value blocks and M's column blocks), then the states, over the segments
        launched = [grid for k, grid in grids if k == kernel]
        ends = [grid for grid in launched if grid[2] == segments - 1]
        states = [grid for grid in launched if grid[2] == segments]
        assert ends and states and all(e[1] > s[1] for e, s in zip(ends, states)), (kernel, launched)
    # the backward's recomputation starts from the forward's walk (ChunkedStates.starts): no ends of its own
    launched = [grid for k, grid in grids if k == "chunked_states_kernel"]
    assert [grid[2] for grid in launched] == [segments - 1, segments, segments], launched
