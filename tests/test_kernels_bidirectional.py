"""The bidirectional linear-attention Triton kernel (state pass, then readout pass) against the
float64 interpreter, through Triton's interpreter on the CPU (DESIGN.md §7): feature maps,
FAVOR+, l2 norm, the sum normalizer, odd lengths, varlen, initial state; outputs and final
state fully written. Shapes are small: the interpreter is slow."""
from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import triton
import triton.language as tl

import attngen
from attngen import codegen, kernel_lib, planner
from attngen.reference import reference
from attngen.testing import FLOAT64_RTOL, Shape, compare, random_inputs, rel_error

from specs import BIDIRECTIONAL as SPECS
from specs import SHIPPED


pytestmark = pytest.mark.usefixtures("triton_backend")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check(name: str, shape: Shape, dtype=torch.float32, initial_state: bool = True, seed: int = 0,
          with_grads: bool = False) -> None:
    op = attngen.load(SPECS[name])
    inputs = random_inputs(op.spec, shape, seed=seed, initial_state=initial_state)
    rows = compare(op.spec, lambda **kw: op(**kw), inputs, dtype, with_grads=with_grads)
    failures = [f"{n}: error {e:.3g} > tolerance {t:.3g}" for n, e, t in rows if not e <= t]
    assert not failures, f"{name} {dtype} on {shape}:\n" + "\n".join(failures)


@pytest.mark.parametrize("initial_state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("name", list(SPECS))
def test_spec_matches_interpreter(name, dname, initial_state):
    """Every feature map, with and without an initial state; two token tiles, the last partial."""
    check(name, Shape(batch=2, q_len=37, heads=2, head_dim=8, value_dim=12), DTYPES[dname], initial_state)


@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 130])
@pytest.mark.parametrize("name", ["identity", "linear_transformer", "performer"])
def test_lengths(name, T):
    check(name, Shape(batch=1, q_len=T, heads=2, head_dim=8, value_dim=6), seed=T)


@pytest.mark.parametrize("K, V", [(20, 5), (8, 70), (72, 40)])
@pytest.mark.parametrize("name", ["identity", "linear_transformer", "performer"])
def test_head_dims(name, K, V):
    """K not a power of two, K < 16 (padded dot lanes), several value blocks, F > 64."""
    check(name, Shape(batch=1, q_len=21, heads=1, head_dim=K, value_dim=V), seed=K)


@pytest.mark.parametrize("initial_state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("name", list(SPECS))
def test_varlen(name, initial_state):
    """Packed sequences, one of length 1, one past a tile: each its own state and initial state."""
    shape = Shape(batch=1, q_len=100, heads=2, head_dim=8, value_dim=6, cu_seqlens=(0, 1, 18, 83, 100))
    check(name, shape, initial_state=initial_state)


@pytest.mark.parametrize("cu", [None, (0, 1, 200, 300)], ids=["dense", "varlen"])
@pytest.mark.parametrize("name", ["identity", "linear_transformer", "performer"])
def test_parts_and_spans(name, cu, monkeypatch, poison_fresh_buffers):
    """Sequences cut into several parts by the state step (their float32 states added after it, one
    part of a one-token sequence empty) and into spans of one token tile by the output step (packed:
    kernel_lib.chunk_slots's slots, spare ones past the end): the interpreter's results, every output
    written (fresh buffers NaN-filled)."""
    monkeypatch.setattr(kernel_lib, "BIDIRECTIONAL_MIN_TILES", 1)
    monkeypatch.setattr(kernel_lib, "BIDIRECTIONAL_SPAN_TILES", 1)
    shape = Shape(batch=1 if cu else 2, q_len=300 if cu else 150, heads=2, head_dim=8, value_dim=6, cu_seqlens=cu)
    N = len(cu) - 1 if cu else 2
    _, _, _, BT, _, _, splits, span = kernel_lib.bidirectional_blocks(N, 2, 8, 8, 6, 300)
    assert splits > 1 and span == BT < 150
    check(name, shape)
    check(name, shape, torch.bfloat16, seed=1)


def test_bidirectional_launch():
    """The bidirectional kernels' blocks (BK, BF, BV, BT, warps, stages, splits, SPAN): a [128, 128] float32 state
    block at eight warps for K = V = 128, narrower value blocks past 128 features, parts enough for two
    programs per multiprocessor (B4 H16: 64 programs, 5 parts of a sequence of 8192 tokens; one part at B4
    T256); FAVOR+'s 32-token tiles, and its float64 projections past 128 key lanes in one stage at 64 value
    lanes (sm_90's shared memory)."""
    blocks = kernel_lib.bidirectional_blocks
    assert blocks(4, 16, 128, 128, 128, 4 * 8192) == (128, 128, 128, 64, 8, 2, 5, 256)
    assert blocks(4, 16, 128, 64, 128, 4 * 8192, "bf16") == (128, 64, 128, 32, 8, 2, 5, 128)
    assert blocks(1, 8, 256, 256, 256, 8192)[:6] == (256, 256, 64, 32, 8, 2)
    assert blocks(1, 2, 256, 64, 256, 1000, "f64")[:6] == (256, 64, 64, 16, 4, 1)
    assert blocks(1, 2, 256, 64, 256, 1000, "bf16")[:6] == (256, 64, 128, 16, 8, 2)
    assert blocks(4, 16, 128, 128, 128, 4 * 256)[6] == 1
    assert blocks(1, 2, 8, 8, 6, 37)[:6] == (16, 16, 16, 64, 4, 2)
    assert [kernel_lib.bidirectional_favor_precision(d, K) for d, K in
            ((torch.float32, 128), (torch.bfloat16, 32), (torch.float16, 64), (torch.bfloat16, 128), (torch.float16, 256))
            ] == ["f64", "ieee", "bf16x3_emulated", "bf16x3_emulated", kernel_lib.chunked_dot_precision(torch.float16)]


@triton.jit
def _favor_dot_kernel(a, b, c, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, PRECISION: tl.constexpr):
    o_m, o_k, o_n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    b_a = tl.load(a + o_m[:, None] * K + o_k[None, :])
    b_b = tl.load(b + o_k[:, None] * N + o_n[None, :])
    tl.store(c + o_m[:, None] * N + o_n[None, :], kernel_lib.favor_dot(b_a, b_b, K, PRECISION))


def test_favor_dot_bf16x3_accuracy():
    """favor_dot's bf16x3 (as the interpreter rounds it) keeps FAVOR+'s projections to about 2^-16 of their
    scale, where one bf16 product (bf16_emulated, through chunked_dot's rounding) is off by about 2^-9: the
    features exp(p) carry that error, relative."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=gen), torch.randn(64, 32, generator=gen)
    exact = a.double() @ b.double()

    def error(precision):
        c = torch.empty(32, 32)
        _favor_dot_kernel[(1,)](a, b, c, 32, 64, 32, PRECISION=precision)
        return ((c.double() - exact).abs().max() / exact.abs().max()).item()

    assert error("bf16x3_emulated") < 2 ** -14
    single = ((a.bfloat16().double() @ b.bfloat16().double() - exact).abs().max() / exact.abs().max()).item()
    assert single > 2 ** -12, "the test's inputs no longer tell one bf16 product from three"


@pytest.mark.parametrize("name", ["linear_transformer", "performer"])
def test_varlen_equals_separate_calls(name):
    op = attngen.load(SPECS[name])
    cu = (0, 1, 18, 83, 100)
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=100, heads=2, head_dim=8, value_dim=6, cu_seqlens=cu),
                           dtype=torch.float32)
    o, ht = op(**inputs, output_final_state=True)
    args = {n: t for n, t in inputs.items() if n not in ("cu_seqlens", "initial_state")}
    for n, (s, e) in enumerate(pairwise(cu)):
        o_n, ht_n = op(**{k: t[:, s:e] for k, t in args.items()}, initial_state=inputs["initial_state"][n:n + 1],
                       output_final_state=True)
        assert rel_error(o[:, s:e], o_n) < 1e-6 and rel_error(ht[n:n + 1], ht_n) < 1e-6


@pytest.mark.parametrize("name", ["linear_transformer", "l2"])
def test_float16(name):
    check(name, Shape(batch=1, q_len=37, heads=2, head_dim=8, value_dim=6), torch.float16)


@pytest.mark.parametrize("name", ["performer", "l2"])
def test_float64_inputs_run_the_pytorch_forms(name, monkeypatch):
    """float64 inputs run the PyTorch forms, not the kernel (which computes in float32): a float64
    state, agreement to the float64 tolerance."""
    op = attngen.load(SPECS[name])
    monkeypatch.setattr(codegen.load_module(op.spec), "op", lambda *a: pytest.fail("a kernel ran on float64"))
    inputs = random_inputs(op.spec, Shape(batch=2, q_len=37, heads=1, head_dim=8, value_dim=6))
    o, ht = op(**inputs, output_final_state=True)
    ref_o, ref_ht = reference(op.spec, **inputs, output_final_state=True)
    assert o.dtype == torch.float64 and ht.dtype == torch.float64
    assert rel_error(o, ref_o) < FLOAT64_RTOL and rel_error(ht, ref_ht) < FLOAT64_RTOL


@pytest.fixture
def kernel_bwd(monkeypatch):
    """name -> (op, calls): the op of a spec with its module's bidirectional_bwd counted (each call
    records whether it got the forward's state to reuse)."""
    def make(name):
        op = attngen.load(SPECS[name])
        module = codegen.load_module(op.spec)
        assert "parallel" in module.BACKWARD_FORMS
        real, calls = module.bidirectional_bwd, []

        def counted(*args):
            calls.append(args[-3] is not None and args[-3].numel() > 0)
            return real(*args)

        monkeypatch.setattr(module, "bidirectional_bwd", counted)
        return op, calls
    return make


def check_grads(kernel_bwd, name, shape, dtype=torch.float32, initial_state=True, seed=0):
    op, calls = kernel_bwd(name)
    inputs = random_inputs(op.spec, shape, seed=seed, initial_state=initial_state)
    rows = compare(op.spec, lambda **kw: op(**kw), inputs, dtype, with_grads=True)
    assert calls == [True], "the kernels' backward did not run once on the forward's state"
    names = {n for n, _, _ in rows}
    assert {"dq", "dk", "dv"} <= names and ("dinitial_state" in names) == initial_state
    failures = [f"{n}: error {e:.3g} > tolerance {t:.3g}" for n, e, t in rows if not e <= t]
    assert not failures, f"{name} {dtype} on {shape}:\n" + "\n".join(failures)


@pytest.mark.usefixtures("poison_fresh_buffers")
@pytest.mark.parametrize("initial_state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("name", list(SPECS))
def test_gradients(kernel_bwd, name, dname, initial_state):
    """The backward's kernels (dS by the state step, dv by the output step, dq and dk by the rows step)
    against the oracle's gradients, a loss on the output and on the final state: every feature map, the
    l2 norm, the sum normalizer, with and without an initial state; every gradient written."""
    check_grads(kernel_bwd, name, Shape(batch=2, q_len=37, heads=2, head_dim=8, value_dim=12), DTYPES[dname],
                initial_state)


@pytest.mark.usefixtures("poison_fresh_buffers")
def test_favor_bf16_projections(kernel_bwd):
    """16-bit inputs from 33 to 128 key lanes: FAVOR+'s projections as bf16 hi / lo parts (kernel_lib.favor_dot,
    bf16x3; the interpreter's rounding of them), forward and every gradient."""
    shape = Shape(batch=1, q_len=65, heads=1, head_dim=72, value_dim=40)
    assert kernel_lib.bidirectional_favor_precision(torch.bfloat16, 72) == "bf16x3_emulated"
    check("performer", shape, torch.bfloat16, seed=72)
    check_grads(kernel_bwd, "performer", shape, torch.bfloat16, seed=72)


@pytest.mark.parametrize("K, V, T", [(20, 5, 1), (8, 130, 21), (72, 40, 65)])
@pytest.mark.parametrize("name", ["identity", "linear_transformer", "performer"])
def test_gradients_head_dims_and_lengths(kernel_bwd, name, K, V, T):
    """One token; K not a power of two; two value blocks (the rows step's loop over them, which also sums the
    normalizer's dO·o for the state step); F > 64; a partial second token tile."""
    check_grads(kernel_bwd, name, Shape(batch=1, q_len=T, heads=1, head_dim=K, value_dim=V), seed=K)


@pytest.mark.usefixtures("poison_fresh_buffers")
@pytest.mark.parametrize("cu", [None, (0, 1, 200, 300)], ids=["dense", "varlen"])
@pytest.mark.parametrize("name", ["identity", "linear_transformer", "performer"])
def test_gradients_parts_and_spans(kernel_bwd, name, cu, monkeypatch):
    """The backward's steps over parts and spans of one token tile, packed sequences (one of one token)."""
    monkeypatch.setattr(kernel_lib, "BIDIRECTIONAL_MIN_TILES", 1)
    monkeypatch.setattr(kernel_lib, "BIDIRECTIONAL_SPAN_TILES", 1)
    shape = Shape(batch=1 if cu else 2, q_len=300 if cu else 150, heads=2, head_dim=8, value_dim=6, cu_seqlens=cu)
    check_grads(kernel_bwd, name, shape)
    check_grads(kernel_bwd, name, shape, torch.bfloat16, seed=1)


@pytest.mark.parametrize("name", ["identity", "performer"])
def test_explain_lists_the_kernels(name):
    """attngen explain's bidirectional steps, forward and backward, are kernels of the spec's module."""
    op = attngen.load(SPECS[name])
    module = codegen.load_module(op.spec)
    forward, backward = planner.bidirectional_steps(op.spec)
    assert [k for k, _ in forward] == ["bidirectional_state_kernel", "bidirectional_output_kernel"]
    assert [k for k, _ in backward] == (["bidirectional_rows_grad_kernel"] + [k for k, _ in forward]
                                        + ["bidirectional_rows_grad_kernel"])
    assert all(callable(getattr(module, k, None)) for k, _ in backward)
    text = planner.explain(planner.plan(op.spec))
    assert "bidirectional kernels, backward, in launch order" in text and ("dz" in text) == (name == "performer")


@pytest.mark.parametrize("name", ["linear_transformer", "performer"])
def test_backward_without_the_saved_state(name):
    """The backward's kernels given no state (what a forward run without for_backward leaves) recompute it:
    the same gradients as from the forward's."""
    op = attngen.load(SPECS[name])
    module = codegen.load_module(op.spec)
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=30, heads=2, head_dim=8, value_dim=6), dtype=torch.float32)
    q, k, v, h0 = (inputs[n] for n in ("q", "k", "v", "initial_state"))
    omega = op.features(8, q.device, torch.float32)
    _, _, saved = module.bidirectional_fwd(q, k, v, omega, h0, None, 0.3, False, True)
    do = torch.randn_like(v)
    got = module.bidirectional_bwd(q, k, v, omega, h0, None, 0.3, saved, do, None)
    again = module.bidirectional_bwd(q, k, v, omega, h0, None, 0.3, q.new_empty(0), do, None)
    for a, b in zip(got, again):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("initial_state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("name", ["identity", "linear_transformer", "performer"])
def test_outputs_fully_written(name, initial_state, poison_fresh_buffers):
    """Outputs allocated NaN-filled (as torch.empty's garbage may be): the kernel writes all of o
    and of the final state (the normalizer column too), across value blocks and varlen."""
    op = attngen.load(SPECS[name])
    shape = Shape(batch=1, q_len=41, heads=2, head_dim=24, value_dim=70, cu_seqlens=(0, 1, 23, 41))
    inputs = random_inputs(op.spec, shape, dtype=torch.float32, initial_state=initial_state)
    assert torch.isnan(torch.empty_like(inputs["v"])).all()
    o, ht = op(**inputs, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    ref_o, ref_ht = reference(op.spec, **inputs, output_final_state=True)
    assert rel_error(o, ref_o) < 1e-5 and rel_error(ht, ref_ht) < 1e-5


def test_favor_plus_exponents_at_k256():
    """FAVOR+ at K = 256, one token, float32: exp turns the projection's absolute error into the
    features' relative error. With float32 dots over the 256 products the output erred 2.4e-6
    here (2.75e-6 on the H200), over float32's 2e-6 floor and 6x plain PyTorch's error; the
    float64 exponents keep to PyTorch's."""
    op = attngen.load(SHIPPED["performer_bidirectional"])
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=1, heads=2, head_dim=256, value_dim=256), seed=257)
    rows = compare(op.spec, lambda **kw: op(**kw), inputs, torch.float32, with_grads=False)
    failures = [f"{n}: error {e:.3g} > tolerance {t:.3g}" for n, e, t in rows if not e <= t]
    assert not failures, "\n".join(failures)
