"""The chunked Triton kernel (and the parallel form, which runs as one chunk of it) against the
float64 interpreter: outputs and final states, through Triton's interpreter on the CPU
(DESIGN.md §7). Shapes are small: the interpreter is slow."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attngen
from attngen import codegen, kernel_lib, planner
from attngen.testing import (FLOAT64_RTOL, Shape, compare, force_launch, kernel_launch, random_inputs, rel_error,
                             spy_launches, tolerance)
from attngen.reference import random_features, reference

import specs
from strategies import causal_linear, legal_specs


pytestmark = pytest.mark.usefixtures("triton_backend")

SPECS = specs.causal_linear("chunked")
DECAYED = ("gated_deltanet", "mamba2", "retnet", "gla", "kda")


def check(name: str, shape: Shape, dtype=torch.float32, form: str = "chunked", chunk: int | None = 16,
          initial_state: bool = True, seed: int = 0, decay_strength: float = 1.0) -> None:
    op = attngen.load(SPECS[name])
    inputs = random_inputs(op.spec, shape, seed=seed, initial_state=initial_state, decay_strength=decay_strength)
    fn = lambda **kw: op(**kw, form=form, chunk_size=chunk if form == "chunked" else None)
    rows = compare(op.spec, fn, inputs, dtype, with_grads=False)
    failures = [f"{n}: error {e:.3g} > tolerance {t:.3g}" for n, e, t in rows if not e <= t]
    assert not failures, f"{name} {form}(chunk={chunk}) {dtype} on {shape}:\n" + "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SPECS))
def test_spec_matches_interpreter(name, dtype):
    """Every spec, several chunks with a partial last one, K != V."""
    check(name, Shape(batch=2, q_len=37, heads=2, head_dim=8, value_dim=12), dtype)


@pytest.mark.parametrize("T, chunk", [(1, 16), (7, 32), (63, 64), (100, 16), (100, 32)])
@pytest.mark.parametrize("name", ["linear_transformer", "gated_deltanet", "gla"])
def test_lengths_and_chunk_sizes(name, T, chunk):
    check(name, Shape(batch=1, q_len=T, heads=2, head_dim=8, value_dim=6), chunk=chunk, seed=T)


@pytest.mark.parametrize("T", [7, 40, 64])
@pytest.mark.parametrize("name", ["performer", "kda", "retnet"])
def test_parallel_form(name, T):
    """The parallel form runs as one chunk of 16, 32 or 64 tokens spanning the sequence."""
    check(name, Shape(batch=2, q_len=T, heads=1, head_dim=8, value_dim=6), form="parallel", chunk=None, seed=T)


@pytest.mark.parametrize("K, V", [(20, 5), (8, 12), (72, 40)])
@pytest.mark.parametrize("name", ["linear_transformer", "kda", "mamba2"])
def test_head_dims(name, K, V):
    """K not a power of two, K < 16 (padded dot lanes), and F > 64 (two value blocks of 32)."""
    check(name, Shape(batch=1, q_len=21, heads=1, head_dim=K, value_dim=V), chunk=16, seed=K)


@pytest.mark.parametrize("initial_state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("name", ["linear_transformer", "performer", "gated_deltanet", "gla", "kda", "retnet"])
def test_varlen(name, initial_state):
    """Packed sequences, one of length 1, each its own chunks and initial state."""
    shape = Shape(batch=1, q_len=57, heads=2, head_dim=8, value_dim=6, cu_seqlens=(0, 1, 18, 50, 57))
    check(name, shape, chunk=16, initial_state=initial_state)


@pytest.mark.parametrize("name", DECAYED)
def test_strong_decay(name):
    """g down to about -20 per token: finite, and still as accurate (float64 cumulative decays)."""
    op = attngen.load(SPECS[name])
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=100, heads=2, head_dim=8, value_dim=6), decay_strength=20)
    if SPECS[name]["decay"] != "constant":  # two per-head constants: strong, but not below -20
        assert float(inputs["g"].min()) < -20
    o, ht = op(**{n: (t.float() if n in ("q", "k", "v") else t) for n, t in inputs.items()},
               output_final_state=True, form="chunked", chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    check(name, Shape(batch=1, q_len=100, heads=2, head_dim=8, value_dim=6), chunk=64, decay_strength=20)


@pytest.mark.parametrize("name", ["linear_transformer", "gated_deltanet", "kda"])
def test_float16(name):
    check(name, Shape(batch=1, q_len=37, heads=2, head_dim=8, value_dim=6), torch.float16, chunk=32)


def test_float16_features_beyond_its_range():
    """FAVOR+ features of fp16 inputs can exceed fp16's 65504 (exp(|w|^2 / 2) for a key along a
    random feature w): the kernels' dots keep them (tf32 operands), the output stays finite and
    right."""
    op = attngen.load(SPECS["performer"])
    shape = Shape(batch=1, q_len=37, heads=2, head_dim=64, value_dim=6)
    inputs = random_inputs(op.spec, shape, seed=3)
    omega = random_features(op.spec, 64)
    # a key along the longest random feature: xs = k K^-1/4 = w, feature exp(|w|^2 / 2) / sqrt(16)
    w = omega[omega.norm(dim=1).argmax()]
    inputs["k"][0, 5, :] = w * 64 ** 0.25
    assert float(w.norm()) ** 2 / 2 > 12          # e^12 / 4 > 65504
    ref_o, ref_s = reference(op.spec, **inputs, output_final_state=True)
    # plain fp16 PyTorch overflows here: the tolerance is fp16's floor, not relative to it
    o, s = op(**{n: (t.half() if n in ("q", "k", "v") else t) for n, t in inputs.items()},
              output_final_state=True, form="chunked", chunk_size=32)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_error(o, ref_o) <= tolerance(torch.float16, None)
    assert rel_error(s, ref_s) <= tolerance(torch.float16, None)


@pytest.mark.parametrize("name", ["gated_deltanet", "kda"])
def test_repeated_keys_in_a_chunk(name):
    """One key repeated over a 64-token chunk with β = 1 and almost no decay: every entry of the
    UT transform's strictly lower A is about 1, so (I + A)^-1 is about I minus the subdiagonal, while
    the powers of A grow to C(14, 7) = 3432 within a 16-token block. The diagonal blocks' inverse
    (forward substitution, or doubling with vector decay) and their products hold fp32's tolerance
    where a power series of A would cancel."""
    op = attngen.load(SPECS[name])
    shape = Shape(batch=1, q_len=64, heads=1, head_dim=8, value_dim=6)
    inputs = random_inputs(op.spec, shape, seed=5, initial_state=False)
    inputs["k"] = inputs["k"][:, :1].expand_as(inputs["k"]).clone()
    inputs["beta"] = torch.ones_like(inputs["beta"])
    inputs["g"] = torch.full_like(inputs["g"], -1e-3)
    fn = lambda **kw: op(**kw, form="chunked", chunk_size=64)  # noqa: E731
    rows = compare(op.spec, fn, inputs, torch.float32, with_grads=False)
    failures = [f"{n}: error {e:.3g} > tolerance {t:.3g}" for n, e, t in rows if not e <= t]
    assert not failures, "\n".join(failures)


def test_float16_written_values_beyond_its_range():
    """The delta rule's values between passes (U) of fp16 inputs keep fp32's range: with orthogonal
    keys and β = 2, the written values are U = 2 V = ±120000 (fp16's largest value is 65504), while
    the outputs, read through the first key alone, stay in range."""
    op = attngen.load(SPECS["deltanet"])
    shape = Shape(batch=1, q_len=8, heads=1, head_dim=8, value_dim=6)
    inputs = random_inputs(op.spec, shape, seed=0, initial_state=False)
    inputs["k"] = torch.eye(8, dtype=torch.float64)[None, :, None, :]
    inputs["q"] = torch.eye(8, dtype=torch.float64)[0].expand_as(inputs["q"]).clone()
    inputs["beta"] = torch.full_like(inputs["beta"], 2.0)
    inputs["v"] = 60000.0 * torch.sign(inputs["v"])
    ref_o, ref_s = reference(op.spec, **inputs, output_final_state=True)
    assert ref_s.abs().max() > 65504
    # plain fp16 PyTorch overflows in U: the tolerance is fp16's floor, not relative to it
    o, s = op(**{n: (t.half() if n in ("q", "k", "v") else t) for n, t in inputs.items()},
              output_final_state=True, form="chunked", chunk_size=16)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_error(o, ref_o) <= tolerance(torch.float16, None)
    assert rel_error(s, ref_s) <= tolerance(torch.float16, None)


@pytest.mark.parametrize("name", ["performer", "gated_deltanet"])
def test_float64_inputs_run_the_pytorch_forms(name, monkeypatch):
    """float64 inputs run the PyTorch forms, not the kernels (which compute in float32): a float64
    state, agreement to the float64 tolerance."""
    op = attngen.load(SPECS[name])
    monkeypatch.setattr(codegen.load_module(op.spec), "op", lambda *a: pytest.fail("a kernel ran on float64"))
    inputs = random_inputs(op.spec, Shape(batch=2, q_len=37, heads=1, head_dim=8, value_dim=6))
    o, ht = op(**inputs, output_final_state=True, form="chunked", chunk_size=16)
    ref_o, ref_ht = reference(op.spec, **inputs, output_final_state=True)
    assert o.dtype == torch.float64 and ht.dtype == torch.float64
    assert rel_error(o, ref_o) < FLOAT64_RTOL and rel_error(ht, ref_ht) < FLOAT64_RTOL


@pytest.mark.parametrize("name", ["linear_transformer", "kda"])
def test_every_output_element_written(name, poison_fresh_buffers):
    """Outputs allocated NaN-filled (as torch.empty's garbage may be): the kernel writes all of
    o and of the final state, across value blocks, varlen and a partial last chunk."""
    op = attngen.load(SPECS[name])
    shape = Shape(batch=1, q_len=41, heads=2, head_dim=72, value_dim=40, cu_seqlens=(0, 1, 23, 41))
    inputs = random_inputs(op.spec, shape)
    inputs = {n: (t.float() if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    assert torch.isnan(torch.empty_like(inputs["v"])).all()
    o, ht = op(**inputs, output_final_state=True, form="chunked", chunk_size=16)
    assert not torch.isnan(o).any() and not torch.isnan(ht).any()
    ref_o, ref_ht = reference(op.spec, **inputs, output_final_state=True)
    assert rel_error(o, ref_o) < 1e-5 and rel_error(ht, ref_ht) < 1e-5


def test_chunk_size_checked():
    """The generated op checks the chunks of the launch it is given (the UT transform works in
    16-token blocks) and its length."""
    op = attngen.load(SPECS["mamba2"])
    module = codegen.load_module(op.spec)
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=8, heads=1, head_dim=8, value_dim=6))
    q, k, v = (inputs[n].float() for n in ("q", "k", "v"))
    launch = kernel_launch(op, {**inputs, "q": q, "k": k, "v": v}, "chunked", 16)[1]
    fields = list(module.ChunkedLaunch._fields)
    for name, value in (("chunk", 8), ("bwd_chunk", 128)):
        bad = list(launch)
        bad[fields.index(name)] = value
        with pytest.raises(ValueError, match=f"chunk.*got {value}"):
            module.op(q, k, v, inputs["g"], None, None, None, None, 1.0, "chunked", bad, False)
    with pytest.raises(ValueError, match=f"launch: expected {len(fields)} ints"):
        module.op(q, k, v, inputs["g"], None, None, None, None, 1.0, "chunked", launch[:-1], False)
    with pytest.raises(ValueError, match="chunk_size: the Triton kernels take 16, 32, 64, got 8"):
        op(q, k, v, inputs["g"], form="chunked", chunk_size=8)


CHUNKED_SHAPES = [Shape(2, 37, 2, 5, 3), Shape(1, 40, 1, 8, 12),
                  Shape(1, 45, 2, 6, 4, cu_seqlens=(0, 1, 20, 45))]


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(legal_specs().filter(causal_linear), st.sampled_from(CHUNKED_SHAPES),
       st.sampled_from([torch.float32, torch.bfloat16]), st.booleans())
def test_any_legal_spec_matches_interpreter(spec_dict, shape, dtype, initial_state):
    """Any legal causal linear spec, chunks of 16 with a partial last one, varlen, K != V:
    outputs and final state."""
    op = attngen.load(spec_dict)
    inputs = random_inputs(op.spec, shape, initial_state=initial_state)
    rows = compare(op.spec, lambda **kw: op(**kw, form="chunked", chunk_size=16), inputs, dtype, with_grads=False)
    for name, err, tol in rows:
        assert err <= tol, f"{name}: rel err {err:.2e} > tol {tol:.2e}"


@pytest.mark.parametrize("name", ["gated_deltanet", "mamba2", "retnet", "performer", "linear_transformer", "gla"])
def test_stored_states_dtype_keeps_outputs(name, monkeypatch):
    """With bf16 inputs the forward stores its chunk-start states in bf16 where the output pass only
    feeds them to its bf16 dots (chunked_states_dtype): the outputs and final states are the same
    bits as with float32 states (the sum normalizer's column has a float32 buffer of its own), vector
    decay's chunks within planner.DECAY_SPAN included."""
    op = attngen.load(SPECS[name])
    module = codegen.load_module(op.spec)
    force_launch(monkeypatch, output_in_states=0)  # the states stored, for the output pass
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=45, heads=2, head_dim=8, value_dim=6,
                                          cu_seqlens=(0, 13, 45)))
    inputs = {n: (t.bfloat16() if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    assert module.chunked_states_dtype(torch.bfloat16) == torch.bfloat16
    assert module.chunked_states_dtype(torch.float16) == torch.float32
    run = lambda: op(**inputs, output_final_state=True, form="chunked", chunk_size=16)  # noqa: E731
    o, ht = run()
    monkeypatch.setattr(module, "chunked_states_dtype", lambda dtype: torch.float32)
    o32, ht32 = run()
    assert torch.equal(o, o32) and torch.equal(ht, ht32)


OUTPUTS_IN_STATES = [name for name in SPECS if planner.output_in_states(attngen.load_spec(SPECS[name]))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["dense", "packed", "segments", "cache"])
@pytest.mark.parametrize("name", OUTPUTS_IN_STATES)
def test_outputs_in_the_state_pass(name, case, dtype, monkeypatch):
    """The forward's outputs computed by its state pass (the launch's output_in_states, planner.output_in_states)
    are the same bits as the output pass's from the stored states, and so is the final state: dense
    sequences with a partial last chunk, packed ones, the pass by segments (a first launch of their end
    states), a serving cache's slots; no output pass and no chunk-start states where it is on. Where the
    dtype cannot take it (the delta rules in float32), the launch asking for it runs the output pass."""
    assert OUTPUTS_IN_STATES, "no shipped spec takes the outputs in the state pass"
    op = attngen.load(SPECS[name])
    can = planner.output_in_states(op.spec, dtype)
    module = codegen.load_module(op.spec)
    packed = case == "packed"
    shape = Shape(batch=1 if packed else 2, q_len=100, heads=2, head_dim=8, value_dim=6,
                  cu_seqlens=(0, 13, 45, 100) if packed else None)
    inputs = random_inputs(op.spec, shape, seed=5)
    inputs = {n: (t.to(dtype) if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    if case == "segments":
        monkeypatch.setattr(kernel_lib, "SEGMENT_MIN_CHUNKS", 1)
    launched = spy_launches(monkeypatch, module, ("chunked_states_kernel", "chunked_output_kernel"))
    monkeypatch.setattr(module, "CHUNKED_OUTPUT_KERNELS", (module.chunked_output_kernel,))
    results = {}
    for on in (0, 1):
        force_launch(monkeypatch, output_in_states=on)
        launched.clear()
        if case == "cache":
            # two requests in slots 2 and 0 of four, from the inputs' initial states
            cache = attngen.StateCache(op, 4, shape.heads, shape.head_dim, shape.value_dim)
            slots = torch.tensor([2, 0])
            cache.state[slots] = inputs["initial_state"].float()
            call = {n: t for n, t in inputs.items() if n != "initial_state"}
            o = op(**call, form="chunked", chunk_size=16, cache=cache, slots=slots)
            results[on] = (o[0] if isinstance(o, tuple) else o, cache.state.clone())
        else:
            results[on] = op(**inputs, output_final_state=True, form="chunked", chunk_size=16)
        kernels = [k for k, _, _ in launched]
        assert ("chunked_output_kernel" in kernels) == (not (on and can)), kernels
        # the state pass's launches (the segments' ends first), each asked for the outputs or not
        states = [(grid[2], kw["OUTPUTS"]) for k, grid, kw in launched if k == "chunked_states_kernel"]
        asked = bool(on and can)
        assert states == ([(6, asked), (7, asked)] if case == "segments" else [(1, asked)]), states
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b), f"{name} {case}: {rel_error(b.float(), a.float()):.2e}"
    rows = compare(op.spec, lambda **kw: op(**kw, form="chunked", chunk_size=16),
                   random_inputs(op.spec, shape, seed=5), dtype, with_grads=False)
    assert all(e <= t for _, e, t in rows), rows


SEGMENTED = ["linear_transformer", "performer", "mamba2", "retnet", "gla"]


@pytest.mark.parametrize("min_chunks, segments", [(1, 7), (3, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", SEGMENTED)
def test_state_pass_in_segments(name, dtype, min_chunks, segments, monkeypatch):
    """The additive rules' state pass by segments of a sequence's chunks, each started from the
    initial state and the segments' end states before it (kernel_lib.chunked_state_segments; the
    H200 splits where the sequences x heads leave SMs idle): 7 chunks of 16 in 7 segments of one, or
    2 of four and three, two sequences, an initial state; outputs and final state."""
    monkeypatch.setattr(kernel_lib, "SEGMENT_MIN_CHUNKS", min_chunks)
    assert kernel_lib.chunked_state_segments(2, 100, 16) == (segments, 7 // segments + (segments == 2))
    check(name, Shape(batch=2, q_len=100, heads=2, head_dim=8, value_dim=6), dtype, seed=min_chunks)


def test_state_segments_policy():
    """One segment for packed sequences and serving caches (split=False), where the programs are over
    half the SMs, or below two segments' worth of chunks; else as many as keep the programs within
    SEGMENT_PROGRAMS, one wave (B1 T32768 H16 at 64 value lanes: 32 programs, 8 segments of 64 chunks);
    the segments cover the chunks."""
    assert kernel_lib.chunked_state_segments(32, 32768, 64, split=False) == (1, 512)
    assert kernel_lib.chunked_state_segments(32, 32768, 64) == (8, 64)
    assert kernel_lib.chunked_state_segments(33, 32768, 64) == (8, 64)
    assert kernel_lib.chunked_state_segments(kernel_lib.SEGMENT_SMS // 2 + 1, 32768, 64) == (1, 512)
    assert kernel_lib.chunked_state_segments(128, 8192, 64) == (1, 128)
    assert kernel_lib.chunked_state_segments(1, 64 * (2 * kernel_lib.SEGMENT_MIN_CHUNKS - 1), 64)[0] == 1
    # the launch's segments (at most that many, of at least SEGMENT_MIN_CHUNKS chunks), whatever the programs
    assert kernel_lib.chunked_state_segments(128, 32768, 64, 8) == (8, 64)
    assert kernel_lib.chunked_state_segments(32, 32768, 64, 1) == (1, 512)
    assert kernel_lib.chunked_state_segments(1, 64 * 10, 64, 16) == (2, 5)
    assert kernel_lib.chunked_state_segments(32, 32768, 64, 8, split=False) == (1, 512)
    for programs in (1, 7, 32, 66):
        G, seg = kernel_lib.chunked_state_segments(programs, 32768 - 5, 64)
        assert G > 1 and (G - 1) * seg < 512 <= G * seg and programs * G <= kernel_lib.SEGMENT_PROGRAMS
