"""Forward kernels on the GPU (compiled mode): every shipped spec x dtype x T x head dim
against the float64 interpreter on the CPU (the float64 PyTorch chunked form at T = 8192,
where the token loop is slow), with tolerances relative to the error of the interpreter run in the
same low precision (attngen.testing.tolerance).

Run on a CUDA machine: bash gpu.sh tests/gpu/<this file>
"""
import pytest
import torch

import attngen
from attngen import planner
from attngen.reference import reference
from attngen.testing import (LOWP_FACTOR, LOWP_FLOOR, Shape, compare, force_launch, random_inputs, rel_error, tolerance,
                             vector_gates_across_span)

from specs import SHIPPED, shipped

SPECS = shipped()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _cases():
    for path in SPECS:
        for dname in DTYPES:
            for T, dims in ((1, (32, 64, 100, 128, 256)), (63, (32, 64, 100, 128, 256)),
                            (1000, (32, 64, 100, 128, 256)), (8192, (64, 128))):
                for d in dims:
                    yield pytest.param(path, dname, T, d, id=f"{path.stem}-{dname}-T{T}-D{d}",
                                       marks=pytest.mark.xdist_group(f"{path.stem}-{dname}"))


def _oracle(op, inputs, T):
    """float64 (o, final state or None)."""
    spec = op.spec
    if not spec.is_linear:
        return reference(spec, **inputs), None
    if T <= 1000:
        return reference(spec, **inputs, output_final_state=True)
    f64 = {n: (t.double() if t.is_floating_point() else t) for n, t in inputs.items()}
    form = "parallel" if spec.mask == "bidirectional" else "chunked"
    call = attngen.inputs.check_linear(spec, **f64)
    args = {n: f64.get(n) for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens")}
    return op._run_torch(call, op.choose(call, form), **args, output_final_state=True)


@pytest.mark.parametrize("path,dname,T,d", list(_cases()))
def test_forward_matches_oracle(path, dname, T, d):
    op = attngen.load(path)
    spec, dtype = op.spec, DTYPES[dname]
    shape = Shape(batch=1, q_len=T, heads=2, head_dim=d, value_dim=d)
    inputs = random_inputs(spec, shape, seed=T + d)
    ref_o, ref_s = _oracle(op, inputs, T)
    low = {n: (t.to(dtype) if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    gpu = {n: t.cuda() for n, t in low.items()}
    if spec.is_linear:
        lp_o, lp_s = reference(spec, **low, output_final_state=True, dtype=dtype)
        o, s = op(**gpu, output_final_state=True)
    else:
        lp_o, lp_s = reference(spec, **low, dtype=dtype), None
        o, s = op(**gpu), None
    assert o.dtype == dtype and torch.isfinite(o).all()
    _assert_close("o", o, ref_o, lp_o, dtype)
    if s is not None:
        _assert_close("final state", s, ref_s, lp_s, dtype)


def _assert_close(what, got, ref, low, dtype):
    """got within the tolerance that the low-precision interpreter's error (low against ref) sets."""
    err, tol = rel_error(got, ref), tolerance(dtype, rel_error(low, ref))
    assert err <= tol, f"{what}: rel err {err:.2e} > tol {tol:.2e}"


@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("dname", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["gla", "kda"])
def test_vector_decay_across_the_span(name, dname, chunk):
    """Vector decays whose 64-token chunks fall on both sides of planner.DECAY_SPAN (the output
    pass's one-dot chunks and chunked_output_blocks_kernel's), D128: outputs, final state and every
    gradient within tolerance of the oracle, at each forward chunk."""
    op = attngen.load(SHIPPED[name])
    shape = Shape(batch=1, q_len=300, heads=2, head_dim=128, value_dim=128)
    inputs = random_inputs(op.spec, shape, seed=chunk)
    inputs["g"] = vector_gates_across_span(shape, seed=chunk)
    rows = compare(op.spec, lambda **kw: op(**kw, form="chunked", chunk_size=chunk), inputs, DTYPES[dname],
                   device="cuda")
    bad = [f"{n}: {e:.2e} > {t:.2e}" for n, e, t in rows if not e <= t]
    assert not bad, "; ".join(bad)


VARLEN = (0, 1, 700, 1500, 1531)


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
@pytest.mark.parametrize("dname", ["fp32", "bf16"])
def test_varlen_and_initial_state(path, dname):
    op = attngen.load(path)
    spec, dtype = op.spec, DTYPES[dname]
    shape = Shape(batch=1, q_len=VARLEN[-1], heads=2, head_dim=64, value_dim=48, cu_seqlens=VARLEN)
    inputs = random_inputs(spec, shape, seed=5)
    rows = compare(spec, lambda **kw: op(**kw), inputs, dtype, with_grads=False, device="cuda")
    bad = [f"{n}: {e:.2e} > {t:.2e}" for n, e, t in rows if not e <= t]
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("name", ["softmax_causal", "sliding_window", "forgetting_attention"])
@pytest.mark.parametrize("tq", [1, 100])
def test_softmax_fewer_queries_than_keys(name, tq):
    op = attngen.load(SHIPPED[name])
    shape = Shape(batch=2, q_len=tq, heads=2, head_dim=128, value_dim=128, k_len=3000)
    inputs = random_inputs(op.spec, shape, seed=tq)
    rows = compare(op.spec, lambda **kw: op(**kw), inputs, torch.bfloat16, with_grads=False, device="cuda")
    bad = [f"{n}: {e:.2e} > {t:.2e}" for n, e, t in rows if not e <= t]
    assert not bad, "; ".join(bad)


# The sum normalizer's column z is a sum carried across the chunked state pass's loop and stored
# inside it (the bidirectional pass carries one too, stored after its loop). Triton 3.6's
# thread-locality pass rewrites a loop-carried sum of a loaded tile, started from a constant (no
# initial state), into per-thread partials merged after the loop: the stores inside the loop would
# read the unchanged start, and where the loop's result is unused (no final state) the pass
# asserts. fp32 inputs at 16 feature lanes, batch 32 (examples/hybrid_lm.py's training on CUDA
# failed to compile there); several chunks, so that a chunk-start z other than the first is read.
@pytest.mark.parametrize("name", ["linear_transformer", "performer", "linear_bidirectional"])
@pytest.mark.parametrize("d", [16, 32])
@pytest.mark.parametrize("final", [False, True], ids=["no_final_state", "final_state"])
def test_normalizer_small_heads_fp32(name, d, final):
    op = attngen.load(SHIPPED[name])
    inputs = random_inputs(op.spec, Shape(batch=32, q_len=200, heads=2, head_dim=d, value_dim=d), seed=d)
    inputs.pop("initial_state", None)
    ref_o, ref_s = reference(op.spec, **inputs, output_final_state=True)
    low = {n: (t.float() if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    lp_o, lp_s = reference(op.spec, **low, output_final_state=True, dtype=torch.float32)
    o, s = op(**{n: t.cuda() for n, t in low.items()}, output_final_state=final)
    _assert_close("o", o, ref_o, lp_o, torch.float32)
    if final:
        _assert_close("final state", s, ref_s, lp_s, torch.float32)


@pytest.mark.parametrize("case", ["dense", "segments", "packed", "cache"])
@pytest.mark.parametrize("dname", ["fp32", "bf16"])
@pytest.mark.parametrize("name", [n for n in SHIPPED if planner.output_in_states(attngen.load_spec(SHIPPED[n]))])
def test_outputs_in_the_state_pass(name, dname, case, monkeypatch):
    """The forward's outputs from its state pass (output_in_states 1, planner.output_in_states) and from the
    output pass over stored states (0), each at 32, 64 and 128 value lanes a program: outputs and final
    state within tolerance of the oracle, and of each other to the dtype's rounding; dense sequences with a
    partial last chunk, the pass by four segments, packed sequences, a serving cache's slots (2 and 0 of 4)."""
    op = attngen.load(SHIPPED[name])
    dtype = DTYPES[dname]
    if not planner.output_in_states(op.spec, dtype):
        pytest.skip(f"{name} takes the outputs in its state pass for bf16 inputs only (planner.output_in_states)")
    cu = VARLEN if case == "packed" else None
    shape = Shape(batch=1 if cu else 2, q_len=VARLEN[-1] if cu else 1000, heads=2, head_dim=128, value_dim=128,
                  cu_seqlens=cu)
    inputs = random_inputs(op.spec, shape, seed=3)
    ref_o, ref_s = reference(op.spec, **inputs, output_final_state=True)
    low = {n: (t.to(dtype) if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    lp_o, lp_s = reference(op.spec, **low, output_final_state=True, dtype=dtype)
    gpu = {n: t.cuda() for n, t in low.items()}
    results = {}
    for on in (0, 1):
        for lanes, warps in ((32, 4), (64, 8), (128, 8)):
            force_launch(monkeypatch, output_in_states=on, states_BV=lanes, states_warps=warps,
                         segments=4 if case == "segments" else 1)
            if case == "cache":
                cache = attngen.StateCache(op, 4, shape.heads, shape.head_dim, shape.value_dim, device=gpu["q"].device)
                slots = torch.tensor([2, 0], device=gpu["q"].device)
                cache.state[slots] = gpu["initial_state"].float()
                o = op(**{n: t for n, t in gpu.items() if n != "initial_state"}, form="chunked", cache=cache, slots=slots)
                o, s = (o[0] if isinstance(o, tuple) else o), cache.state[slots]
            else:
                o, s = op(**gpu, output_final_state=True, form="chunked")
            what = f"output_in_states={on}, {lanes} lanes"
            _assert_close(f"o ({what})", o, ref_o, lp_o, dtype)
            _assert_close(f"final state ({what})", s, ref_s, lp_s, dtype)
            results[on, lanes] = o
    tol = LOWP_FACTOR * LOWP_FLOOR[dtype]
    for lanes in (32, 64, 128):
        err = rel_error(results[1, lanes].float(), results[0, lanes].float())
        assert err <= tol, f"{lanes} lanes: output_in_states 1 against 0: {err:.2e} > {tol:.2e}"
