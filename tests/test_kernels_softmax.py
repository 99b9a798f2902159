"""The softmax Triton kernel (FlashAttention-2 forward) against the float64 interpreter,
through Triton's interpreter on the CPU (DESIGN.md §7): causal, bidirectional and sliding-window
masks, the scalar-decay bias, Tq < Tk, K != V, varlen; outputs and lse fully written; key tiles
outside the mask never read. Shapes are small: the interpreter is slow."""
from __future__ import annotations

from itertools import pairwise

import pytest
import torch

import attngen
from attngen import codegen
from attngen.reference import reference, softmax_allowed
from attngen.testing import Shape, compare, kernel_launch, random_inputs, rel_error

from specs import SOFTMAX as SPECS


pytestmark = pytest.mark.usefixtures("triton_backend")

DECAYED = ("forgetting", "window_decay")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check(name: str, shape: Shape, dtype=torch.float32, seed: int = 0, decay_strength: float = 1.0,
          with_grads: bool = False) -> None:
    op = attngen.load(SPECS[name])
    inputs = random_inputs(op.spec, shape, seed=seed, decay_strength=decay_strength)
    rows = compare(op.spec, lambda **kw: op(**kw), inputs, dtype, with_grads=with_grads)
    failures = [f"{n}: error {e:.3g} > tolerance {t:.3g}" for n, e, t in rows if not e <= t]
    assert not failures, f"{name} {dtype} on {shape}:\n" + "\n".join(failures)


@pytest.mark.parametrize("T", [1, 7, 63, 100, 130])
@pytest.mark.parametrize("name", list(SPECS))
def test_masks_and_lengths(name, T):
    """Every mask and the decay bias; one partial query block up to three (two of them partial
    for the masks' edges), K != V."""
    check(name, Shape(batch=2, q_len=T, heads=2, head_dim=16, value_dim=24), seed=T)


@pytest.mark.parametrize("T", [7, 130])
@pytest.mark.parametrize("name", list(SPECS))
def test_bfloat16(name, T):
    check(name, Shape(batch=1, q_len=T, heads=2, head_dim=16, value_dim=24), torch.bfloat16, seed=T)


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("Tq, Tk", [(1, 37), (5, 70), (63, 130)])
@pytest.mark.parametrize("name", list(SPECS))
def test_fewer_queries_than_keys(name, Tq, Tk, dname):
    """Queries aligned to the end of the keys (decode with a KV cache is Tq = 1)."""
    check(name, Shape(batch=2, q_len=Tq, k_len=Tk, heads=2, head_dim=16, value_dim=16), DTYPES[dname], seed=Tk)


@pytest.mark.parametrize("K, V", [(24, 40), (100, 8), (8, 100), (16, 256), (256, 16)])
@pytest.mark.parametrize("name", ["causal", "window3", "forgetting"])
def test_head_dims(name, K, V):
    """K != V, dims that are not powers of two (masked lanes), below 16 (padded dot lanes), 256."""
    check(name, Shape(batch=1, q_len=70, heads=1, head_dim=K, value_dim=V), seed=K + V)


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("name", list(SPECS))
def test_varlen(name, dname):
    """Packed sequences: one of length 1, and query blocks of 64 that run past a sequence's end
    (65 = 64 + 1, 70) next to sequences shorter than one block."""
    shape = Shape(batch=1, q_len=153, heads=2, head_dim=16, value_dim=8, cu_seqlens=(0, 1, 66, 83, 153))
    check(name, shape, DTYPES[dname])


@pytest.mark.parametrize("name", DECAYED)
def test_strong_decay(name):
    """g down to about -20 per token: finite, and still as accurate (G rebased per block)."""
    op = attngen.load(SPECS[name])
    shape = Shape(batch=1, q_len=130, heads=2, head_dim=16, value_dim=16)
    inputs = random_inputs(op.spec, shape, decay_strength=20)
    assert float(inputs["g"].min()) < -20
    o = op(**{n: (t.float() if n in ("q", "k", "v") else t) for n, t in inputs.items()})
    assert torch.isfinite(o).all()
    for dtype in DTYPES.values():
        check(name, shape, dtype, decay_strength=20)
    check(name, Shape(batch=1, q_len=100, heads=2, head_dim=16, value_dim=16, cu_seqlens=(0, 1, 66, 100)),
          decay_strength=20)


@pytest.mark.parametrize("name", ["causal", "window16", "forgetting"])
def test_float16(name):
    check(name, Shape(batch=1, q_len=70, heads=2, head_dim=16, value_dim=24), torch.float16)


@pytest.mark.parametrize("name", ["bidirectional", "window3", "window_decay"])
def test_float64(name):
    """float64 inputs accumulate in float64: agreement to the float64 tolerance."""
    check(name, Shape(batch=1, q_len=70, k_len=100, heads=2, head_dim=24, value_dim=8), torch.float64)


def test_gradients_through_the_op():
    """The op keeps the signature the runtime's autograd wraps (backward: the PyTorch form)."""
    check("window_decay", Shape(batch=1, q_len=20, k_len=30, heads=2, head_dim=8, value_dim=6), with_grads=True)


@pytest.mark.parametrize("name", ["causal", "forgetting"])
def test_varlen_equals_separate_calls(name):
    op = attngen.load(SPECS[name])
    cu = (0, 1, 66, 83, 153)
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=153, heads=2, head_dim=16, value_dim=8, cu_seqlens=cu),
                           dtype=torch.float32)
    packed = op(**inputs)
    args = {n: t for n, t in inputs.items() if n != "cu_seqlens"}
    for s, e in pairwise(cu):
        alone = op(**{n: t[:, s:e] for n, t in args.items()})
        assert rel_error(packed[:, s:e], alone) < 1e-6


@pytest.mark.parametrize("name", ["causal", "window3", "forgetting"])
def test_decode_equals_last_row(name):
    """One query against the whole KV cache is the last row of the full call."""
    op = attngen.load(SPECS[name])
    inputs = random_inputs(op.spec, Shape(batch=2, q_len=77, heads=2, head_dim=16, value_dim=8), dtype=torch.float32)
    full = op(**inputs)
    last = op(**{**inputs, "q": inputs["q"][:, -1:]})
    assert rel_error(last, full[:, -1:]) < 1e-6


def _lse_oracle(spec, q, k, g, scale, cu_seqlens):
    """float64 natural-log log-sum-exp of each query's allowed scores: [B, H, Tq] or [H, total]."""
    q, k = q.double(), k.double()
    bounds = [(b, 0, k.shape[1]) for b in range(q.shape[0])] if cu_seqlens is None else \
        [(0, s, e) for s, e in zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist())]
    out = []
    for b, s, e in bounds:
        qs = q[b, s:e] if cu_seqlens is not None else q[b]
        ks = k[b, s:e]
        Tq, Tk = qs.shape[0], ks.shape[0]
        sc = scale * torch.einsum("thk,jhk->htj", qs, ks)
        if g is not None:
            G = torch.cumsum(g[b, s:e].double(), 0).T
            pos = torch.arange(Tq) + (Tk - Tq)
            sc = sc + G[:, pos, None] - G[:, None, :]
        sc = sc.masked_fill(~softmax_allowed(spec, Tq, Tk), float("-inf"))
        out.append(torch.logsumexp(sc, -1))
    return torch.cat(out, -1) if cu_seqlens is not None else torch.stack(out)


@pytest.mark.parametrize("case", ["dense", "varlen", "decode"])
@pytest.mark.parametrize("name", ["bidirectional", "window3", "window_decay"])
def test_outputs_fully_written(name, case, poison_fresh_buffers):
    """Outputs allocated NaN-filled (as torch.empty's garbage may be): the kernel writes every
    element of o and of lse, and lse is the log-sum-exp of the allowed scores."""
    op = attngen.load(SPECS[name])
    module = codegen.load_module(op.spec)
    shape = {"dense": Shape(batch=2, q_len=70, heads=2, head_dim=24, value_dim=40),
             "varlen": Shape(batch=1, q_len=153, heads=2, head_dim=24, value_dim=40, cu_seqlens=(0, 1, 66, 83, 153)),
             "decode": Shape(batch=2, q_len=3, k_len=70, heads=2, head_dim=24, value_dim=40)}[case]
    inputs = random_inputs(op.spec, shape, dtype=torch.float32)
    q, k, v, g, cu = (inputs.get(n) for n in ("q", "k", "v", "g", "cu_seqlens"))
    scale = op.spec.default_scale(q.shape[-1])
    o, lse = module.forward(q, k, v, g, cu, scale, None, kernel_launch(op, inputs)[1])
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert lse.shape == ((2, 2, shape.q_len) if cu is None else (2, shape.q_len)) and lse.dtype == torch.float32
    assert rel_error(o, reference(op.spec, **inputs)) < 1e-5
    assert rel_error(lse, _lse_oracle(op.spec, q, k, g, scale, cu)) < 1e-6


@pytest.mark.parametrize("name", ["causal", "window3", "window_decay"])
def test_masked_key_tiles_are_not_read(name):
    """NaN in the values of keys that a query block cannot see: the kernel must skip their tiles
    (a masked tile would still multiply the NaN by a zero weight, as the oracle does). Blocks
    are at most 64 wide: under a window of <= 16 queries from 128 on never need key 0; under
    the causal mask queries before 128 never need the last key."""
    op = attngen.load(SPECS[name])
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=256, heads=2, head_dim=16, value_dim=16), dtype=torch.float32)
    clean = op(**inputs)
    poisoned_v = inputs["v"].clone()
    if op.spec.mask == "sliding_window":
        poisoned_v[:, 0] = float("nan")
        rows = slice(128, 256)
    else:
        poisoned_v[:, 255] = float("nan")
        rows = slice(0, 128)
    o = op(**{**inputs, "v": poisoned_v})
    assert torch.isfinite(o[:, rows]).all()
    assert torch.equal(o[:, rows], clean[:, rows])
    assert torch.isnan(o).any()  # the poison is there for the queries that do see it


# Calls whose tiles end mid-tile in every way a launch's knobs must hold to: partial last tiles, packed
# sequences, Tq < Tk, shared key heads
TILE_CASES = {"dense": Shape(batch=2, q_len=70, heads=2, head_dim=32, value_dim=16),
              "varlen": Shape(batch=1, q_len=153, heads=2, head_dim=16, value_dim=32, cu_seqlens=(0, 1, 66, 83, 153)),
              "fewer_queries": Shape(batch=2, q_len=5, k_len=70, heads=2, head_dim=16, value_dim=16),
              "gqa": Shape(batch=2, q_len=40, heads=4, kv_heads=2, head_dim=16, value_dim=16)}


def _with_tma(op, inputs, tma: int) -> list[int]:
    """The op's launch for inputs with its knobs tma, dq_tma and dkdv_tma set (the forward's and the dq
    pass's key and value tiles, the dk/dv pass's query and output-gradient tiles by tensor descriptors;
    tma 2: the backward passes' unmasked tiles alone, the forward's every tile)."""
    launch = kernel_launch(op, inputs)[1]
    fields = codegen.load_module(op.spec).SoftmaxLaunch._fields
    launch[fields.index("tma")] = min(tma, 1)
    launch[fields.index("dq_tma")] = launch[fields.index("dkdv_tma")] = tma
    return launch


@pytest.mark.parametrize("dname", ["bf16", "fp16"])
@pytest.mark.parametrize("case", list(TILE_CASES))
@pytest.mark.parametrize("name", ["causal", "bidirectional", "window3", "forgetting"])
def test_tma_tiles_equal_pointer_loads(name, case, dname):
    """The key and value tiles through tensor descriptors (launch knobs tma, dq_tma) give the pointer
    loads' outputs and lse bit for bit and their gradients, the backward passes' with every tile or
    their unmasked ones by descriptors (dq_tma and dkdv_tma 1, 2): partial last tiles, packed sequences,
    Tq < Tk, shared key heads."""
    op = attngen.load(SPECS[name])
    module = codegen.load_module(op.spec)
    shape = TILE_CASES[case]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dname]
    inputs = random_inputs(op.spec, shape, seed=3)
    inputs = {n: (t.to(dtype) if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    q, k, v, g, cu = (inputs.get(n) for n in ("q", "k", "v", "g", "cu_seqlens"))
    assert attngen.kernel_lib.tile_descriptor(k, 16) is not None
    scale = op.spec.default_scale(q.shape[-1])
    runs = [module.forward(q, k, v, g, cu, scale, None, _with_tma(op, inputs, tma)) for tma in (0, 1)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert rel_error(runs[1][0], reference(op.spec, **inputs)) < 2e-2
    o, lse = runs[0]
    do = torch.randn_like(o)
    grads = [module.backward(q, k, v, g, cu, scale, None, _with_tma(op, inputs, tma), o, lse, do, None)
             for tma in (0, 1, 2)]
    # the gradients to a rounding of the dots' sums (the interpreter multiplies a transposed tile as a
    # strided array: its sums may round apart by an ulp of the 16-bit output)
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert (a is None and b is None) or float((a - b).abs().max()) <= 2 ** -7 * float(a.abs().max())


@pytest.mark.parametrize("dname", ["fp32", "bf16"])
@pytest.mark.parametrize("case", list(TILE_CASES))
@pytest.mark.parametrize("name", ["causal", "bidirectional", "window3", "forgetting"])
def test_dk_and_dv_in_launches_of_their_own_equal_one_launch(name, case, dname, poison_fresh_buffers):
    """The dk/dv pass split in two launches (knob dkdv_split: dv alone, then dk and the decay's column
    sums of dS alone) gives the one launch's gradients bit for bit, and each of its outputs is written
    (fresh buffers poisoned): partial tiles, packed sequences, Tq < Tk, shared key heads, the decay's dg."""
    op = attngen.load(SPECS[name])
    module = codegen.load_module(op.spec)
    shape = TILE_CASES[case]
    inputs = random_inputs(op.spec, shape, seed=4)
    inputs = {n: (t.to(DTYPES[dname]) if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    q, k, v, g, cu = (inputs.get(n) for n in ("q", "k", "v", "g", "cu_seqlens"))
    scale = op.spec.default_scale(q.shape[-1])
    launch = kernel_launch(op, inputs)[1]
    split = module.SoftmaxLaunch._fields.index("dkdv_split")
    o, lse = module.forward(q, k, v, g, cu, scale, None, launch)
    do = torch.randn_like(o)
    grads = {}
    for flag in (0, 1):
        launch[split] = flag
        grads[flag] = module.backward(q, k, v, g, cu, scale, None, launch, o, lse, do, None)
    assert (grads[1][3] is not None) == (name == "forgetting")
    for one, two in zip(grads[0], grads[1]):
        assert (one is None and two is None) or torch.equal(one, two)
    assert all(t is None or torch.isfinite(t).all() for t in grads[1])


@pytest.mark.parametrize("tma", [1, 2])
@pytest.mark.parametrize("name", ["causal", "forgetting"])
def test_tma_tiles_read_no_other_sequence(name, tma):
    """A partial last key tile read by the copy engine holds the next sequence's first rows: NaN and inf
    there (keys and values) leave this sequence's outputs as they were."""
    op = attngen.load(SPECS[name])
    module = codegen.load_module(op.spec)
    inputs = random_inputs(op.spec, Shape(batch=2, q_len=70, heads=2, head_dim=16, value_dim=16), seed=5)
    inputs = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    launch = _with_tma(op, inputs, tma)
    q, k, v, g = (inputs.get(n) for n in ("q", "k", "v", "g"))
    scale = op.spec.default_scale(16)
    clean = module.forward(q, k, v, g, None, scale, None, launch)[0]
    k2, v2 = k.clone(), v.clone()
    k2[1], v2[1, ::2], v2[1, 1::2] = float("nan"), float("inf"), float("-inf")
    o, lse = module.forward(q, k2, v2, g, None, scale, None, launch)
    assert torch.equal(o[0], clean[0])
    # the dq pass reads the keys and values as the forward does; the dk/dv pass the queries and output
    # gradients of a partial last tile
    do = torch.randn_like(o)
    grads = module.backward(q, k, v, g, None, scale, None, launch, o, lse, do, None)
    q2, do2 = q.clone(), do.clone()
    q2[1], do2[1] = float("nan"), float("inf")
    poisoned = module.backward(q2, k2, v2, g, None, scale, None, launch, o, lse, do2, None)
    for a, b in zip(grads[:3], poisoned[:3]):
        assert torch.equal(a[0], b[0])


def test_tile_descriptor_takes_only_whole_aligned_16_bit_heads():
    x = torch.zeros(2, 8, 3, 64, dtype=torch.bfloat16)
    assert attngen.kernel_lib.tile_descriptor(x, 32) is not None
    assert attngen.kernel_lib.tile_descriptor(x.float(), 32) is None           # 32-bit
    assert attngen.kernel_lib.tile_descriptor(x[..., :48], 32) is None          # not a power of two, strided
    assert attngen.kernel_lib.tile_descriptor(x.transpose(1, 2), 32) is None    # not contiguous
    misaligned = torch.zeros(x.numel() + 8, dtype=torch.bfloat16)[1:1 + x.numel()].view(x.shape)
    assert attngen.kernel_lib.tile_descriptor(misaligned, 32) is None
