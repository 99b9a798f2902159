"""The generated modules' spec-independent pieces, written once: the Triton helpers their kernels
call (the log-decay floor, the dot operands' rounding and precision, FAVOR+'s exponents) and the
host-side policy of their launchers (dot precision and decay dtype per input dtype, the dtype of
the tiles passed between the chunked steps, the slots of packed chunks, the chunk sizes the kernels
take, the softmax lse's dtype, packed lengths, key splits and scale), and the softmax kernels no spec
changes (the split-KV merge, the backward's preprocess). A generated module imports what it uses from
here; what differs between specs stays in its template. Imports torch and triton only (and the
constants of attngen.spec): a generated module used on its own loads none of the compiler.

Changing a helper here changes every module's kernels at once: their PTX before and after is
compared with `bench/compile_time.py --ptx` (BENCHMARKS.md).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .spec import KERNEL_CHUNKS, LOG_DECAY_FLOOR, LOG_DECAY_FLOOR32

# what a generated module may import (codegen imports in each the names its code calls)
__all__ = ["BIDIRECTIONAL_MIN_TILES", "BIDIRECTIONAL_SPAN_TILES", "LOG2E", "SEGMENT_MIN_CHUNKS", "SEGMENT_PROGRAMS",
           "SEGMENT_SMS", "bidirectional_blocks", "bidirectional_favor_precision", "ceil_div", "chunk_slots", "chunked_blocks",
           "chunked_cast", "chunked_check_chunk", "chunked_decay_dtype", "chunked_dot", "chunked_dot_precision",
           "chunked_fp32_dot", "chunked_pass_dtype", "chunked_qk_group", "chunked_round", "chunked_segment_starts", "chunked_segment_starts_kernel",
           "chunked_segment_transition", "chunked_segments", "chunked_segments_agree", "chunked_solve_dot",
           "chunked_state_segments", "favor_dot",
           "favor_exponent_row", "favor_exponent_tile", "favor_exponent_tile_t", "favor_grad_tile", "floor_log_decay",
           "interpreted", "packed_max_len", "pow2_ceil", "pow2_floor", "softmax_append_done",
           "softmax_append_rows", "softmax_bwd_preprocess_kernel", "softmax_decay_pairs", "softmax_kv_split_len", "softmax_lse_dtype", "softmax_scaled", "softmax_segment_cumsum",
           "softmax_segment_cumsum_kernel", "softmax_split_merge", "tile_descriptor", "tile_descriptors"]

LOG2E = 1.4426950408889634

# the floors as the kernels read them (a Triton kernel reads a global only as a constexpr)
_FLOOR = tl.constexpr(LOG_DECAY_FLOOR)
_FLOOR32 = tl.constexpr(LOG_DECAY_FLOOR32)


def interpreted():
    """Triton's interpreter runs the kernels (CPU tensors, TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# --------------------------------------------------------------------------- Triton helpers

@triton.jit
def floor_log_decay(x):
    # every log decay the kernels take a cumulative sum of is raised to LOG_DECAY_FLOOR (-1e4,
    # attngen.spec) where it is loaded, to LOG_DECAY_FLOOR32 (-200) where the sum is taken in
    # float32: exp underflows to exactly 0 below either in float32 (and below -1e4 in float64), and
    # log decays are <= 0, so a sum with a floored term is too: results are unchanged, while a
    # reset (g = -inf) no longer makes a difference of cumulative log decays -inf - -inf = NaN;
    # NaN stays NaN
    if x.dtype == tl.float64:
        y = tl.where(x < _FLOOR, _FLOOR, x)
    else:
        y = tl.where(x < _FLOOR32, _FLOOR32, x)
    return y


@triton.jit
def chunked_round(x, DROP: tl.constexpr):
    # fp32 (or bf16) -> the nearest value DROP mantissa bits shorter (ties to even), kept in fp32: the
    # value a bf16 (DROP 16) or tf32 (DROP 13) tl.dot operand holds
    b_bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    b_bits = (b_bits + ((1 << (DROP - 1)) - 1) + ((b_bits >> DROP) & 1)) & (0xFFFFFFFF ^ ((1 << DROP) - 1))
    return b_bits.to(tl.float32, bitcast=True)


@triton.jit
def chunked_cast(x, dtype: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # float32 x -> dtype, to nearest (ties to even) as the GPU casts: Triton's interpreter truncates
    # float32 to bf16, so there ("bf16_emulated") the value is rounded first and its cast is exact
    if DOT_PRECISION == "bf16_emulated" and dtype == tl.bfloat16:
        x = chunked_round(x, 16)
    return x.to(dtype)


@triton.jit
def chunked_dot(a, b, DOT_PRECISION: tl.constexpr, acc=None):
    # a @ b (+ acc, float32) on float32 tiles (or bf16 ones, with "bf16*"). "ieee": fp32 products
    # (fp64 inputs, and the interpreter); "tf32x3": fp32 inputs on the tensor cores, each operand
    # split in two tf32 parts (three products, about fp32's accuracy); "tf32": fp16 inputs, operands
    # rounded to tf32, which has fp16's mantissa and fp32's range (FAVOR+ features and states
    # outgrow fp16's 65504); "bf16": bf16 operands. "*_emulated": the same operand rounding,
    # multiplied in fp32 (Triton's interpreter multiplies bf16 operands as raw bits and tf32 ones
    # unrounded). A sum of two products is one accumulating into the other (acc), never two dot
    # results added.
    if DOT_PRECISION == "bf16":
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif DOT_PRECISION == "bf16_emulated":
        c = tl.dot(chunked_round(a, 16), chunked_round(b, 16), acc, input_precision="ieee")
    elif DOT_PRECISION == "tf32":
        c = tl.dot(a, b, acc, input_precision="tf32")
    elif DOT_PRECISION == "tf32_emulated":
        c = tl.dot(chunked_round(a, 13), chunked_round(b, 13), acc, input_precision="ieee")
    elif DOT_PRECISION == "tf32x3":
        c = tl.dot(a, b, acc, input_precision="tf32x3")
    else:
        c = tl.dot(a, b, acc, input_precision="ieee")
    return c


@triton.jit
def chunked_fp32_dot(a, b, DOT_PRECISION: tl.constexpr, acc=None):
    # a @ b (+ acc) on float32 tiles at about float32's accuracy whatever the inputs' DOT_PRECISION:
    # fp32 products where they are exact or emulated (fp64 inputs, the interpreter), else tf32x3
    if DOT_PRECISION == "ieee" or DOT_PRECISION == "bf16_emulated" or DOT_PRECISION == "tf32_emulated":
        c = tl.dot(a, b, acc, input_precision="ieee")
    else:
        c = tl.dot(a, b, acc, input_precision="tf32x3")
    return c


@triton.jit
def chunked_solve_dot(a, b, DOT_PRECISION: tl.constexpr, acc=None):
    # a @ b (+ acc) on float32 tiles inside the UT step's inverse (I + A)^-1 (its 16-token blocks'
    # products), at the precision the inputs' dtype leaves room for: tf32 operands for 16-bit inputs
    # ("bf16", "tf32"; emulated in the interpreter), whose inverse is rounded to bf16 when stored or
    # enters tf32 dots (fp16) -- tf32's 2^-11 is under both roundings; fp32 products ("ieee", on the
    # CUDA cores) for float32 and float64 inputs. H200, gated_deltanet B4 T8192 H16 K = V = 128 bf16:
    # the UT step 466 -> 426 us against "ieee" (BENCHMARKS.md 2026-12-04, seventh run).
    if DOT_PRECISION == "bf16" or DOT_PRECISION == "tf32":
        c = chunked_dot(a, b, "tf32", acc)
    elif DOT_PRECISION == "bf16_emulated" or DOT_PRECISION == "tf32_emulated":
        c = chunked_dot(a, b, "tf32_emulated", acc)
    else:
        c = chunked_dot(a, b, "ieee", acc)
    return c


# FAVOR+'s exponents w_m . x - |x|^2 / 2 of x = q K^-1/4 (or k), summed in float64 and rounded once:
# exp turns their absolute error into the features' relative error, and float32 dots over K = 256
# erred some 4e-6 there, 4x plain PyTorch (performer_bidirectional at T = 1, BENCHMARKS.md).
@triton.jit
def favor_exponent_row(w, x):
    # w [BF, BK], x [BK] -> [BF]
    x = x.to(tl.float64)
    return (tl.sum(w.to(tl.float64) * x[None, :], 1) - 0.5 * tl.sum(x * x, 0)).to(tl.float32)


# The tiles' projections: PRECISION is "f64" (float64 dots: the bidirectional form's, float32
# inputs) or the kernel's DOT_PRECISION. Triton 3.6 does not lower float64 dots in every layout
# ("fp64 don't support largeK MMA": the chunked backward, the bidirectional form's bf16 tiles), and
# the chunked state pass at K = 256 lacks the shared memory they take. 16-bit inputs ("bf16",
# "tf32") project on the tensor cores at "tf32x3" (each fp32 operand in two tf32 parts) up to 128
# key lanes: as "ieee" CUDA-core products the [BT, BK] tiles spilled and took most of each step's
# time (performer bf16 B4 T8192 H16 K = V = 128 on the H200, fwd+bwd 49.7 -> 13.7 ms, BENCHMARKS.md
# 2026-12-03); past 128 lanes their tf32 operands asked for 262,144 B of shared memory. float32
# inputs keep "ieee": tf32x3 drops the low parts' product, which exp turns into the features'
# relative error, over float32's tolerances. The bidirectional kernels' 16-bit inputs take "bf16x3"
# (bidirectional_favor_precision): ptxas, performer_bidirectional bf16 B4 T8192 H16 D128 on sm_90, the
# output step 240 -> 125 registers (two programs per SM), the rows step 255 registers and 36 B spilled ->
# 181 and none (bench/compile_time.py --bwd --h100).
@triton.jit
def favor_dot(a, b, BK: tl.constexpr, PRECISION: tl.constexpr):
    # a @ b, one of the operands [.., BK] or [BK, ..] of q or k lanes
    if PRECISION == "f64":
        c = tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee")
    elif PRECISION == "bf16x3" or PRECISION == "bf16x3_emulated":
        # each float32 operand as bf16 hi + lo parts, three products (lo x lo dropped): about 2^-16 relative,
        # on the tensor cores with bf16 operands, which take half the registers and shared memory of tf32x3's
        # float32 ones ("_emulated": the interpreter's, the parts rounded by chunked_round, fp32 products)
        if PRECISION == "bf16x3":
            a_hi, b_hi = a.to(tl.bfloat16), b.to(tl.bfloat16)
            a_lo, b_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16), (b - b_hi.to(tl.float32)).to(tl.bfloat16)
            c = tl.dot(a_hi, b_hi, tl.dot(a_lo, b_hi, tl.dot(a_hi, b_lo)))
        else:
            a_hi, b_hi = chunked_round(a, 16), chunked_round(b, 16)
            a_lo, b_lo = chunked_round(a - a_hi, 16), chunked_round(b - b_hi, 16)
            c = tl.dot(a_hi, b_hi, tl.dot(a_lo, b_hi, tl.dot(a_hi, b_lo, input_precision="ieee"),
                                          input_precision="ieee"), input_precision="ieee")
    elif (PRECISION == "bf16" or PRECISION == "tf32") and BK <= 128:
        c = tl.dot(a, b, input_precision="tf32x3")
    else:
        c = tl.dot(a, b, input_precision="ieee")
    return c


@triton.jit
def favor_exponent_tile(x, w_t, PRECISION: tl.constexpr):
    # x [BT, BK], w_t [BK, BF] -> [BT, BF]
    if PRECISION == "f64":
        x = x.to(tl.float64)
    return (favor_dot(x, w_t, x.shape[1], PRECISION) - 0.5 * tl.sum(x * x, 1)[:, None]).to(tl.float32)


@triton.jit
def favor_exponent_tile_t(w, x, PRECISION: tl.constexpr):
    # w [BF, BK], x [BK, BT] -> [BF, BT]
    if PRECISION == "f64":
        x = x.to(tl.float64)
    return (favor_dot(w, x, x.shape[0], PRECISION) - 0.5 * tl.sum(x * x, 0)[None, :]).to(tl.float32)


@triton.jit
def favor_grad_tile(dp, w, xs, PRECISION: tl.constexpr):
    # through p = w x' - |x'|^2 / 2: dp [BT, BF], w [BF, BK], xs = x' [BT, BK] -> dx' [BT, BK]
    return favor_dot(dp, w, w.shape[1], PRECISION) - xs * tl.sum(dp, 1)[:, None]


# --------------------------------------------------------------------------- launch policy: chunked

def chunked_dot_precision(dtype):
    """The chunked kernels' DOT_PRECISION for inputs of this dtype."""
    if dtype == torch.float16:
        return "tf32_emulated" if interpreted() else "tf32"
    if dtype == torch.bfloat16:
        return "bf16_emulated" if interpreted() else "bf16"
    return "ieee" if interpreted() or dtype == torch.float64 else "tf32x3"


def chunked_decay_dtype(dtype):
    """G_DTYPE: the dtype of the chunked kernels' cumulative log decays, G, its differences and the
    decay gradient's sums inside a chunk. float64 for float32 and float64 inputs; float32 for 16-bit
    ones, whose outputs round to 2^-8 (bf16) or 2^-11 (fp16) relative: a chunk's sums in float32 stay
    within about 3e-5 of exact at log decays down to -5, and within 1e-3 with every one at the floor
    (LOG_DECAY_FLOOR32, floor_log_decay). Half the registers of float64 tiles: kda's training step
    16.1 -> 12.8 ms on the H200 (bf16 B4 T8192 H16 K = V = 128; BENCHMARKS.md)."""
    return tl.float32 if dtype in (torch.bfloat16, torch.float16) else tl.float64


def chunked_pass_dtype(dtype):
    """The dtype of the tiles the chunk-parallel step hands to the later passes (K ⊙ Γ_C/Γ; W, U, (I + A)^-1): bf16
    for bf16 inputs, whose dots take bf16 operands (one rounding, the one those dots make anyway;
    half the bytes), float32 otherwise: fp16 inputs' dots take tf32 operands for fp32's range
    (features and (I + A)^-1 V outgrow fp16's 65504), fp32 and fp64 inputs keep fp32 accuracy."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


# --------------------------------------------------------------------------- host integers
# The launchers' grid and block arithmetic in plain Python: triton.cdiv and triton.next_power_of_2 are
# Triton ConstexprFunctions, about 2 us a call on the host (Triton 3.6), which a decode step or a small
# call pays several times over.

def ceil_div(a, b):
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def pow2_ceil(n):
    """The smallest power of two >= n (1 for n < 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


def chunk_slots(cu_seqlens, B, T, chunk):
    """The slots of the per-chunk buffers: (chunk_offsets, chunk_seq, n_slots). Sequence n's
    chunk c is slot n * cdiv(T, chunk) + c; with cu_seqlens, slot chunk_offsets[n] + c, and
    chunk_seq[slot] is the slot's sequence. sum_n cdiv(len_n, chunk) <= cdiv(T, chunk) + N bounds
    the slots without reading the lengths back to the host; spare slots map past the last
    sequence's end."""
    if cu_seqlens is None:
        return None, None, B * ceil_div(T, chunk)
    N = cu_seqlens.numel() - 1
    lens = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk - 1) // chunk
    ends = torch.cumsum(lens, 0)
    n_slots = ceil_div(T, chunk) + N
    chunk_seq = torch.searchsorted(ends, torch.arange(n_slots, device=cu_seqlens.device), right=True).clamp_(max=N - 1)
    return ends - lens, chunk_seq, n_slots


def chunked_qk_group(q, v):
    """QK_GROUP: the value heads of v per query / key head of q (grouped value heads; 1 without)."""
    return v.shape[2] // q.shape[2]


def chunked_blocks(K, F, launch):
    """(BK, BF, BV): key, feature and value lanes of the chunked kernels."""
    # tl.dot takes no dim below 16: narrower lanes are padded (and masked)
    return max(16, pow2_ceil(K)), max(16, pow2_ceil(F)), launch.BV


# The sequential state passes split each sequence into segments of chunks where their programs (one
# per sequence x head and value block) leave most SMs idle: a single long sequence at B1 H16 runs 32
# programs on the H200's 132 SMs. Each segment's end state is linear in its start state: for the
# additive rules S_end = D S_start + E (D the segment's decay, E its own end state from zeros), a
# first launch computes every segment's E and D, a second starts each segment from the initial state
# and the E, D before it (a scan over the segments, in registers) and stores its chunk-start states.
# For the delta rules S_end = M S_start + E with M [K, K], walked between the launches by
# chunked_segment_starts_kernel; gated_deltanet B1 T32768 H16 bf16 at 8 segments of 64 value lanes,
# against one of 16 lanes: fwd+bwd 6.110 -> 5.213 ms, deltanet 5.192 -> 4.665, the forward 1.261 ->
# 1.277 and 1.122 -> 1.181 (BENCHMARKS.md 2026-12-05, fourth run).
# bf16 B1 T32768 H16 K = V = 128 on the H200 (BENCHMARKS.md 2026-12-03), fwd+bwd at 9 segments against 1:
# mamba2 4.197 -> 2.645 ms, retnet 4.128 -> 2.561, linear_transformer 5.944 -> 4.278, gla 11.781 ->
# 6.397. Not at B4 T8192 (128 programs), where 3 segments measured slower (mamba2 2.369 -> 2.434,
# linear_transformer 3.580 -> 3.862; the forward slower for every spec): a split only where the
# programs are at most half the SMs, into as many segments of at least SEGMENT_MIN_CHUNKS chunks as
# keep them within SEGMENT_PROGRAMS, one wave of two programs per SM. At B1 T32768 H16 bf16 on the
# H100, 32 programs: 8 segments (256 programs) against 9 (288, past the wave): gated_deltanet fwd+bwd
# 6.319 -> 5.990 ms, mamba2 3.031 -> 2.921 (BENCHMARKS.md 2026-12-05, fourth run).
SEGMENT_SMS = 132
SEGMENT_PROGRAMS = 2 * SEGMENT_SMS
SEGMENT_MIN_CHUNKS = 4


def chunked_state_segments(programs, T, chunk, segments=0, split=True):
    """(G, SEG): the state passes' segments of each sequence, G of SEG chunks, for a pass of `programs`
    programs per segment over sequences of T tokens. segments (the launch's): at most this many, each
    of at least SEGMENT_MIN_CHUNKS chunks; 0, the policy above.
    split False: one segment (G = 1), as packed sequences take (their lengths are not read back to the
    host) and a serving cache (read and written in place: the last segment's final state would
    overwrite the initial state another segment reads)."""
    n = ceil_div(T, chunk)
    G = 1
    if split and segments:
        G = max(1, min(segments, n // SEGMENT_MIN_CHUNKS))
    elif split and 2 * programs <= SEGMENT_SMS:
        G = max(1, min(SEGMENT_PROGRAMS // programs, n // SEGMENT_MIN_CHUNKS))
    seg = ceil_div(n, G)
    return ceil_div(n, seg), seg


def chunked_segments(N, H, V, T, chunk, launch, split):
    """(G, SEG) of a chunked state pass at `chunk` (chunked_state_segments) over N sequences of T tokens,
    H value heads of V lanes, at the launch's value blocks (states_BV) and segments; split as there."""
    return chunked_state_segments(N * H * ceil_div(V, launch.states_BV), T, chunk, launch.segments, split=split)


def chunked_segments_agree(q, v, cu_seqlens, launch):
    """Whether a call's forward state pass (at launch.chunk) and its backward's (at launch.bwd_chunk) both
    run by segments and split the sequences at the same tokens: q [B, T, HK, K], v [B, T, H, V]; packed
    sequences (cu_seqlens) run one segment."""
    if cu_seqlens is not None:
        return False
    B, T, H, V = q.shape[0], q.shape[1], v.shape[2], v.shape[3]
    G, seg = chunked_segments(B, H, V, T, launch.chunk, launch, split=True)
    bwd_G, bwd_seg = chunked_segments(B, H, V, T, launch.bwd_chunk, launch, split=True)
    return G > 1 and G == bwd_G and seg * launch.chunk == bwd_seg * launch.bwd_chunk


# The bidirectional form's launch (templates/linear_bidirectional.py.jinja): its two steps parallel over the
# tokens. The state step splits each sequence into parts until its programs make a wave of two per SM
# (SEGMENT_PROGRAMS; each part at least BIDIRECTIONAL_MIN_TILES token tiles, and the parts' float32 states
# are added after it); the output step reads a sequence's state once per span of SPAN_TILES tiles.
BIDIRECTIONAL_MIN_TILES = 4
BIDIRECTIONAL_SPAN_TILES = 4


def bidirectional_blocks(N, H, K, F, V, T, favor=None, rows=False):
    """(BK, BF, BV, BT, warps, stages, splits, SPAN) of the bidirectional kernels for N sequences (T tokens in
    all) of H value heads, K key lanes, F features and V value lanes; favor: the FAVOR_PRECISION of a map whose
    features are a dot's result (FAVOR+: bidirectional_favor_precision), None for other maps; rows: the
    backward's span steps (the rows gradients and dv)."""
    # tl.dot takes no dim below 16: narrower lanes are padded (and masked)
    BK, BF = max(16, pow2_ceil(K)), max(16, pow2_ceil(F))
    # a state block [BF, BV] of at most 16K float32 (64 KiB of registers across eight warps), at most 128 lanes
    BV = min(max(16, pow2_ceil(V)), 128, max(16, 16384 // BF))
    # token tiles [BT, BK] and [BT, BF] of at most 32 KiB in float32; 16 KiB where the features are a dot's,
    # whose float32 operands (tf32x3) Triton stages in shared memory
    BT = min(64, max(16, (8192 if favor is None else 4096) // max(BK, BF)))
    stages = 2
    if favor == "f64" and BK > 128:
        # float64 projections (float32 inputs) past 128 key lanes: Omega [BK, BF] and the token tiles in
        # float64 take most of the shared memory (311,296 B at K = 256 with 256 value lanes in two stages,
        # past sm_90's 232,448): one stage, 64 value lanes
        BV, stages = min(BV, 64), 1
    if rows:
        # the rows step stages the [BF, BV] float32 state block per token tile: in one stage it takes half the
        # shared memory (linear_bidirectional: two programs per SM) and ran faster on an H100 (bf16 B4 T8192
        # H16 D128: 357 -> 236 us, performer_bidirectional 2129 -> 1794; BENCHMARKS.md, 2026-12-05 eighth run)
        stages = 1
    warps = 4 if BF * BV <= 4096 else 8
    programs = N * H * ceil_div(V, BV)
    splits = max(1, min(ceil_div(SEGMENT_PROGRAMS, programs), ceil_div(T, N * BT * BIDIRECTIONAL_MIN_TILES)))
    return BK, BF, BV, BT, warps, stages, splits, BT * BIDIRECTIONAL_SPAN_TILES


def bidirectional_favor_precision(dtype, K):
    """FAVOR_PRECISION, the bidirectional kernels' FAVOR+ projections (favor_dot): float64 for float32
    inputs; for 16-bit ones, fp32 products ("ieee") up to 32 key lanes, where the causal kernels' tf32x3
    projections gave wrong bf16 outputs (runtime.FAVOR_BF16_REASON), bf16 hi / lo parts on the tensor cores
    up to 128 (bf16x3), the kernel's precision past that (favor_dot: fp32 products)."""
    if dtype == torch.float32:
        return "f64"
    if K <= 32:
        return "ieee"
    if K <= 128:
        return "bf16x3_emulated" if interpreted() else "bf16x3"
    return chunked_dot_precision(dtype)


@triton.jit
def chunked_segment_transition(b_s, p_m, p_s, stride, o_f, m_f, o_v, m_v, F: tl.constexpr, BKB: tl.constexpr,
                               DOT_PRECISION: tl.constexpr):
    # b_s [BF, BV] + M S, M [F, F] at p_m (rows of F) and S's value block [F, BV] at p_s (rows of
    # `stride`), both read by column / row blocks of BKB: no [F, F] tile is ever whole
    for i_k in range(0, tl.cdiv(F, BKB)):
        o_k = i_k * BKB + tl.arange(0, BKB)
        m_k = o_k < F
        b_m = tl.load(p_m + o_f[:, None] * F + o_k[None, :], mask=m_f[:, None] & m_k[None, :], other=0.0)
        b_sk = tl.load(p_s + o_k[:, None] * stride + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_s = chunked_fp32_dot(b_m, b_sk.to(tl.float32), DOT_PRECISION, b_s)
    return b_s


@triton.jit
def chunked_segment_starts_kernel(s0, e, m, NE, H: tl.constexpr, F: tl.constexpr, V: tl.constexpr, VS: tl.constexpr,
                                  BF: tl.constexpr, BV: tl.constexpr, BKB: tl.constexpr, HAS_S0: tl.constexpr,
                                  REVERSE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # The delta rule's segments (hooks.TransitionSegments): segment j maps the state entering it to
    # M_j S + E_j, M_j [F, F] in m [N, NE, H, F, F] and E_j [F, V] in e [N, NE, H, F, V] (float32), as
    # the first launch of a state pass stored them. One program per (sequence x head, value block)
    # walks them in order from s0 [N, H, F, VS] (or zeros; REVERSE: the last first, the backward's
    # gradients) and writes each state it reaches over the E it came from: row j of e then holds the
    # state leaving segment j, which the next segment starts from (the state pass's second launch),
    # and which the next step of the walk reads back by blocks of BKB rows (M_j by column blocks:
    # [F, F] whole would take 256 KB of shared memory at F = 256). At about float32's accuracy
    # (chunked_fp32_dot); a kernel of its own, so that M takes no registers or shared memory from the
    # state pass.
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    o_f = tl.arange(0, BF)
    o_v = i_v * BV + tl.arange(0, BV)
    m_f, m_v = o_f < F, o_v < V
    m_fv = m_f[:, None] & m_v[None, :]
    # the first segment, from s0 or zeros
    j = NE - 1 if REVERSE else 0
    o_e = (i_n.to(tl.int64) * NE + j) * H + i_h
    p_e = e + o_e * F * V + o_f[:, None] * V + o_v[None, :]
    b_s = tl.load(p_e, mask=m_fv, other=0.0)
    if HAS_S0:
        b_s = chunked_segment_transition(b_s, m + o_e * F * F, s0 + i_nh.to(tl.int64) * F * VS, VS, o_f, m_f, o_v, m_v,
                                         F, BKB, DOT_PRECISION)
    tl.store(p_e, b_s, mask=m_fv)
    for i in range(1, NE):
        j = i
        if REVERSE:
            j = NE - 1 - i
        o_p = o_e
        o_e = (i_n.to(tl.int64) * NE + j) * H + i_h
        p_e = e + o_e * F * V + o_f[:, None] * V + o_v[None, :]
        b_s = tl.load(p_e, mask=m_fv, other=0.0)
        # the row the step before stored, by all of the program's threads: read back by others
        tl.debug_barrier()
        b_s = chunked_segment_transition(b_s, m + o_e * F * F, e + o_p * F * V, V, o_f, m_f, o_v, m_v, F, BKB,
                                         DOT_PRECISION)
        tl.store(p_e, b_s, mask=m_fv)


def chunked_segment_starts(s0, e, m, grid, H, F, V, VS, BF, BV, DOT_PRECISION, reverse):
    """Launch chunked_segment_starts_kernel over a state pass's grid (sequences x heads, value blocks): e
    [N, G - 1, H, F, V] and m [N, G - 1, H, F, F] as its first launch stored them, s0 the state the walk
    starts from or None. Eight warps and one stage; M and the state read back by blocks of 64 (ptxas
    figures: BENCHMARKS.md 2026-12-05, fourth run)."""
    chunked_segment_starts_kernel[grid](s0, e, m, e.shape[1], H, F, V, VS, BF=BF, BV=BV, BKB=min(BF, 64),
                                        HAS_S0=s0 is not None, REVERSE=reverse, DOT_PRECISION=DOT_PRECISION,
                                        num_warps=8, num_stages=1)


def chunked_check_chunk(chunk):
    """The chunk sizes the chunked kernels take (KERNEL_CHUNKS)."""
    if chunk not in KERNEL_CHUNKS:
        raise ValueError(f"chunk: the chunked kernel takes {', '.join(map(str, KERNEL_CHUNKS[:-1]))} or "
                         f"{KERNEL_CHUNKS[-1]} tokens per chunk, got {chunk!r}")


# --------------------------------------------------------------------------- launch policy: softmax

def pow2_floor(n):
    """The largest power of two <= n (1 for n < 1)."""
    return 1 << (max(n, 1).bit_length() - 1)


def softmax_lse_dtype(dtype):
    """The lse's dtype for inputs of `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def packed_max_len(cu_seqlens, max_len):
    """The longest packed sequence: max_len when the caller knows it, else read back from
    cu_seqlens (a device sync)."""
    return max_len if max_len is not None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def softmax_kv_split_len(Tk, splits, BN):
    """(splits, keys per split) covering Tk keys in about `splits` parts of whole key tiles."""
    if splits <= 1:
        return 1, Tk
    split_len = ceil_div(ceil_div(Tk, splits), BN) * BN
    return ceil_div(Tk, split_len), split_len


def softmax_scaled(q, scale):
    """(q, qk_scale): the scale in log2 units as the kernel's float argument; float64 inputs carry it
    in q instead (a Triton float argument is float32: folded into q, float64 stays exact), and 1."""
    qk_scale = scale * LOG2E
    if q.dtype == torch.float64:
        return q * qk_scale, 1.0
    return q, qk_scale


def tile_descriptor(x, rows):
    """A tensor descriptor (TMA, Hopper's bulk tensor copies) of x [.., heads, dim] contiguous, read as
    [tokens, heads * dim] in tiles of `rows` tokens by one whole head ([rows, dim] at column head * dim),
    or None where the copy engine cannot take x: 16-bit inputs only, dim a power of two from 16 to 256
    (a tile is one head, no masked lanes), the base 16-byte aligned. Rows past the last token read as
    zeros; rows past a sequence's end inside the tensor are the next sequence's, which the kernels mask."""
    dim = x.shape[-1]
    if (x.element_size() != 2 or dim < 16 or dim > 256 or dim & (dim - 1) or not x.is_contiguous()
            or x.data_ptr() % 16):
        return None
    flat = x.view(-1, x.shape[-2] * dim)
    return TensorDescriptor(flat, list(flat.shape), [flat.shape[1], 1], [rows, dim])


def tile_descriptors(rows, *xs):
    """tile_descriptor of each x for a kernel that streams them all by the copy engine or none of them:
    a tuple of descriptors, or of Nones where one of the xs cannot be taken (the kernel's TMA is then
    off: descs[0] is None)."""
    descs = tuple(tile_descriptor(x, rows) for x in xs)
    return descs if None not in descs else (None,) * len(xs)


# --------------------------------------------------------------------------- softmax kernels
# The softmax kernels and helpers that no spec changes: the merge of split-KV partials, a decode call's append inside
# the forward, the backward's preprocess and, for a scalar decay's score bias (forgetting attention), the cumsums of
# its log decays.


@triton.jit
def softmax_append_rows(
    # pointers
    k_new, v_new, k_cache, v_cache,
    # the new tokens' first row in k_new, v_new; the slot's first row in the cache; its held keys; the new tokens
    q_bos, k_bos, n_held, T_new, L, i_hk,
    HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """A serving call's append of at most BT new tokens: the new keys and values of key head i_hk (rows
    q_bos + t of k_new, v_new [tokens, HK, *]) written to the slot's rows k_bos + (n_held + t) % L of the
    cache [S * L, HK, *]. kv_append_kernel calls it by BT tokens (a token's HK heads as one row: HK 1); the
    forward kernel, appending a decode step's tokens itself, calls it and then a barrier, after which its
    threads read them back from the cache with the rest."""
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_t = o_t < T_new
    # [BT] the tokens' rows in the input and in the slot
    i_src = (q_bos + o_t) * HK + i_hk
    i_dst = (k_bos + (n_held + o_t) % L) * HK + i_hk
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    tl.store(k_cache + i_dst[:, None] * K + o_k[None, :],
             tl.load(k_new + i_src[:, None] * K + o_k[None, :], mask=m_tk, other=0.0), mask=m_tk)
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    tl.store(v_cache + i_dst[:, None] * V + o_v[None, :],
             tl.load(v_new + i_src[:, None] * V + o_v[None, :], mask=m_tv, other=0.0), mask=m_tv)


@triton.jit
def softmax_append_done(seq_count, length, new_length, programs):
    """A serving call's append inside its forward kernel, last part: each of a sequence's `programs` programs
    counts itself done at seq_count (int32, zero before the first call) when it finished, having read the
    slot's length at its start; the last one sets the length to new_length and the count back to zero. The
    barrier and the count's release and acquire (GPU scope) order every program's read of the length before
    the store."""
    tl.debug_barrier()
    done = tl.atomic_add(seq_count, 1, sem="acq_rel", scope="gpu")
    if done == programs - 1:
        tl.store(length, new_length.to(length.dtype.element_ty))
        tl.store(seq_count, 0)


@triton.jit
def softmax_split_merge(
    # pointers
    o_part, lse_part, o, lse, split_count,
    # the block's count; its first query row's offsets into o ([tokens x H] rows of V, a row every H) and
    # into lse, and its real rows
    i_count, i_q0, o_lse0, n_rows, splits, o_split_stride, lse_split_stride,
    H: tl.constexpr, V: tl.constexpr, BS: tl.constexpr, BV: tl.constexpr,
):
    """Split-KV's merge, run by each of a query block's split programs after it stored its partial
    output and lse: the last of them to finish merges all the block's partials, row by row, each in one
    load of its splits' [BS] lse and [BS, BV] outputs: o = sum_s w_s o_s with w_s = exp(lse_s - lse),
    lse = log sum_s exp(lse_s); then it sets the block's count back to zero for the next call.
    split_count [blocks] int32 (zeros before the first call) counts the block's finished splits at
    i_count. The barrier puts every thread's stores of the partial before the count is taken, whose
    release and acquire (GPU scope) order them before the last program's loads, which bypass the SM's
    L1 (cache_modifier .cg: no line of an earlier call is read)."""
    tl.debug_barrier()
    done = tl.atomic_add(split_count + i_count, 1, sem="acq_rel", scope="gpu")
    if done == splits - 1:
        o_s = tl.arange(0, BS)
        o_v = tl.arange(0, BV)
        m_s, m_v = o_s < splits, o_v < V
        for i_r in range(n_rows):
            i_q = i_q0 + i_r * H
            # [BS] the splits' lse of the row (float64); a split that saw no key of it has -inf
            b_lse = tl.load(lse_part + o_s.to(tl.int64) * lse_split_stride + o_lse0 + i_r, mask=m_s,
                            other=float("-inf"), cache_modifier=".cg").to(tl.float64)
            b_max = tl.max(b_lse, 0)
            b_w = tl.where(m_s, tl.exp(b_lse - b_max), 0.0)
            b_sum = tl.sum(b_w, 0)
            # [BS, BV]
            b_o = tl.load(o_part + o_s[:, None].to(tl.int64) * o_split_stride + i_q * V + o_v[None, :],
                          mask=m_s[:, None] & m_v[None, :], other=0.0, cache_modifier=".cg")
            b_out = tl.sum(b_o * (b_w / b_sum).to(b_o.dtype)[:, None], 0)
            tl.store(o + i_q * V + o_v, b_out.to(o.dtype.element_ty), mask=m_v)
            tl.store(lse + o_lse0 + i_r, (b_max + tl.log(b_sum)).to(lse.dtype.element_ty))
        tl.store(split_count + i_count, 0)


@triton.jit
def softmax_bwd_preprocess_kernel(
    # pointers
    o, do, lse, dlse, delta, lse2,
    # dims
    Tq, H: tl.constexpr, V: tl.constexpr,
    # meta
    BT: tl.constexpr, BV: tl.constexpr, IS_FP64: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """delta = rowsum(o * do) - dlse (HAS_DLSE: a gradient reached the lse) and lse2 = lse * log2(e),
    all [B, H, Tq] ([H, T] packed: B = 1)."""
    i_bh, i_t = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    ACC = tl.float64 if IS_FP64 else tl.float32
    o_t = i_t * BT + tl.arange(0, BT)
    o_v = tl.arange(0, BV)
    m_t, m_v = o_t < Tq, o_v < V
    i_tok = (i_b.to(tl.int64) * Tq + o_t) * H + i_h
    # [BT, BV]
    b_o = tl.load(o + i_tok[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0).to(ACC)
    b_do = tl.load(do + i_tok[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0).to(ACC)
    i_row = (i_b.to(tl.int64) * H + i_h) * Tq + o_t
    # [BT]
    b_delta = tl.sum(b_o * b_do, 1)
    if HAS_DLSE:
        b_delta -= tl.load(dlse + i_row, mask=m_t, other=0.0).to(ACC)
    tl.store(delta + i_row, b_delta, mask=m_t)
    b_lse = tl.load(lse + i_row, mask=m_t, other=0.0).to(ACC)
    tl.store(lse2 + i_row, b_lse * 1.4426950408889634, mask=m_t)


@triton.jit
def softmax_segment_cumsum_kernel(
    # pointers
    x, out, cu_seqlens,
    # dims
    T, H: tl.constexpr,
    # meta
    BT: tl.constexpr, BH: tl.constexpr, FLOOR: tl.constexpr,
):
    """out = the inclusive cumsum of x [B, T, H] along each sequence of cu_seqlens (a batch row or a
    packed sequence), in float64 from the sequence's first token: nothing crosses into another
    sequence. One program per sequence and BH heads. FLOOR: x is a log decay, raised to the floor
    where it is loaded."""
    i_n, i_hb = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T_seq = (tl.load(cu_seqlens + i_n + 1) - bos).to(tl.int32)
    o_h = i_hb * BH + tl.arange(0, BH)
    m_h = o_h < H
    # [BH] the sum over the sequence's tokens before the current block
    b_carry = tl.zeros([BH], dtype=tl.float64)
    for i_t in range(0, T_seq, BT):
        o_t = i_t + tl.arange(0, BT)
        m_th = (o_t < T_seq)[:, None] & m_h[None, :]
        i_x = (bos + o_t)[:, None] * H + o_h[None, :]
        # [BT, BH]
        b_x = tl.load(x + i_x, mask=m_th, other=0.0).to(tl.float64)
        if FLOOR:
            b_x = floor_log_decay(b_x)
        tl.store(out + i_x, tl.cumsum(b_x, 0) + b_carry[None, :], mask=m_th)
        b_carry += tl.sum(b_x, 0)


def softmax_segment_cumsum(x, cu_seqlens, floor):
    """x [B, T, H] contiguous -> float64 [B, T, H]: the inclusive cumsum along T within each
    sequence (each batch row, or each packed sequence of cu_seqlens); floor: x is a log decay,
    raised to the log-decay floor first."""
    x = x.contiguous()
    B, T, H = x.shape
    if cu_seqlens is None:
        # a batch row is a sequence. (torch.cumsum along T of [B, T, H] scans the outer dim, one
        # thread per (batch, head) walking T: 1.5 ms at B4 T8192 H16 on the H200, 4.4 of the 20.5
        # ms of forgetting attention's training step; BENCHMARKS.md 2026-12-02)
        cu_seqlens = torch.arange(0, B + 1, device=x.device, dtype=torch.int32) * T
    out = torch.empty(B, T, H, dtype=torch.float64, device=x.device)
    # one program per sequence and 4 heads walks its tokens in [BT, BH] tiles of 4096 elements
    BH = min(4, pow2_ceil(H))
    BT = min(1024, max(16, 4096 // BH))
    softmax_segment_cumsum_kernel[(cu_seqlens.numel() - 1, ceil_div(H, BH))](
        x, out, cu_seqlens, T, H, BT=BT, BH=BH, FLOOR=floor, num_warps=4)
    return out


def softmax_decay_pairs(g, cu_seqlens, is_fp64):
    """g [B, Tk, H] contiguous -> (g_hi, g_lo) [B, Tk, H]: G, the inclusive cumsum of the floored g
    along each sequence in log2 units, as float32 g_hi = G rounded and g_lo = the remainder
    (float64 inputs: G and 0)."""
    gc = softmax_segment_cumsum(g, cu_seqlens, True) * LOG2E
    if is_fp64:
        return gc, torch.zeros_like(gc)
    g_hi = gc.to(torch.float32)
    return g_hi, (gc - g_hi.to(torch.float64)).to(torch.float32)
