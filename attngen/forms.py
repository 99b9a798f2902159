"""The stages of the lowered forms, in PyTorch (DESIGN.md §4).

Each function here is one stage of a plan (planner.py names them and wires them into a DAG).
A stage takes the frozen `Ctx` of the call plus named tensors and returns named tensors.
Layouts: the user's [B, T, H, *]; inside the forms [N, H, L, *] (one row per independent
sequence, L padded to a whole number of chunks with tokens that leave the state unchanged);
chunked tensors [N, H, n, C, *].

Math of one chunk (local tokens t = 1..C, chunk-start state S0, G_t the cumulative log
decay inside the chunk, Γ_t = exp(G_t), decay ratios exp(G_t - G_i) <= 1 for i <= t):
  additive: U = V
  delta:    (I + A) U = diag(β) V - diag(β) (K ⊙ Γ) S0,  A_ti = β_t k_t·diag(Γ_t/Γ_i) k_i (i < t)
            so U = Ũ - W S0 with Ũ = T diag(β) V, W = T diag(β) (K ⊙ Γ), T = (I + A)^-1 (solved)
  output:   O = (Q ⊙ Γ) S0 + P U,  P_ti = q_t·diag(Γ_t/Γ_i) k_i (i <= t)
  state:    S_C = Γ_C S0 + (K ⊙ Γ_C/Γ)^T U
Only exponentials of differences of cumulative decays appear, never exp(-cumsum).

Packed sequences (cu_seqlens) are computed apart: padding is selected, never multiplied in
(0 * NaN is NaN), so a non-finite value in one sequence reaches no other.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch.linalg import solve_triangular

from .inputs import Call
from .spec import L2_EPS, LOG_DECAY_FLOOR, NORM_EPS, Spec


@dataclasses.dataclass(frozen=True)
class Ctx:
    """What every stage of one call may read besides its tensor inputs."""

    spec: Spec
    call: Call
    chunk: int                  # C; the padded length L is a multiple of it
    dtype: torch.dtype          # compute dtype: float64 for float64 inputs, else float32
    device: torch.device
    omega: torch.Tensor | None  # FAVOR+ random features [F, K]
    phi: Callable | None        # the elementwise feature map as a torch function (None for FAVOR+)


# --------------------------------------------------------------------------- shared stages

def feature_map(ctx: Ctx, q, k):
    """q, k [B, T, H, K] -> q_hat, k_hat [B, T, H, F]: phi, l2 norm, scale (on q)."""
    return query_features(ctx, q), _features(ctx, k)


def share_qk_heads(ctx: Ctx, q_hat, k_hat):
    """Grouped value heads: [B, T, H, F] query and key features -> [B, T, HV, F], value head h
    reading query / key head h // (HV / H)."""
    return repeat_heads(ctx.call.heads // ctx.call.qk_heads, 2, q_hat, k_hat)


def repeat_heads(group: int, dim: int, *xs):
    """Each head of xs repeated `group` times along dim (consecutive heads share a source head)."""
    return xs if group == 1 else tuple(x.repeat_interleave(group, dim) for x in xs)


def query_features(ctx: Ctx, q):
    """q [B, T, H, K] -> q_hat [B, T, H, F]: phi, l2 norm and scale."""
    return _features(ctx, q) * ctx.call.scale


def _features(ctx: Ctx, x):
    x = _phi(ctx, x.to(ctx.dtype))
    if ctx.spec.qk_norm == "l2":
        x = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)
    return x


def _phi(ctx: Ctx, x):
    """[..., K] -> [..., F]: the elementwise map ctx.phi, or FAVOR+ (the exponent's square
    subtracted inside the exp, so it stays finite for large |x|)."""
    if ctx.phi is not None:
        return ctx.phi(x)
    xs = x * x.shape[-1] ** -0.25
    proj = xs @ ctx.omega.to(x.dtype).T
    return torch.exp(proj - 0.5 * (xs * xs).sum(-1, keepdim=True)) * ctx.omega.shape[0] ** -0.5


# Log decays are raised to LOG_DECAY_FLOOR (spec.py). exp underflows to exactly 0 below about -745
# in float64 (-104 in float32), so a gate of exactly zero (g = -inf, a reset) gives the same
# results, while differences of cumulative log decays stay finite (-inf - -inf is NaN). Sums of
# floors stay exact to float64 rounding over any chunk. The kernels apply the same floor where
# they load g.
def floor_log_decay(g):
    """g raised to LOG_DECAY_FLOOR (NaN stays NaN; the gradient below the floor is 0, as is
    that of exp(g) at g = -inf)."""
    return g.clamp(min=LOG_DECAY_FLOOR)


def log_decay(ctx: Ctx, g):
    """g -> per-token log decay [B, T, H, Fg] (Fg = 1 for none/constant/scalar, F for vector),
    floored at LOG_DECAY_FLOOR."""
    B, T, H = ctx.call.batch, ctx.call.q_len, ctx.call.heads
    if ctx.spec.decay == "none":
        return torch.zeros(B, T, H, 1, dtype=ctx.dtype, device=ctx.device)
    g = floor_log_decay(g.to(ctx.dtype))
    if ctx.spec.decay == "constant":
        return g[None, None, :, None].expand(B, T, H, 1)
    return g[..., None] if ctx.spec.decay == "scalar" else g


def normalizer_column(ctx: Ctx, v):
    """v [B, T, H, V] -> [v, 1]: the sum normalizer is the additive rule on a column of ones."""
    v = v.to(ctx.dtype)
    return torch.cat([v, torch.ones_like(v[..., :1])], -1)


def _pack(ctx: Ctx, x, cu_seqlens, valid):
    """[B, T, H, *] -> [N, H, L, *]; padded tokens are zero."""
    if x is None:
        return None
    x = x.to(ctx.dtype)
    if cu_seqlens is not None:
        N, L = valid.shape
        # a padded slot gathers some token of the next sequence; select zero there, since
        # multiplying by zero would carry that token's NaN or inf into this sequence
        idx = (cu_seqlens[:-1, None] + torch.arange(L, device=x.device)).clamp(max=x.shape[1] - 1)
        x = torch.where(valid.reshape(N, L, *[1] * (x.dim() - 2)), x[0][idx], 0.0)
    pad = -x.shape[1] % ctx.chunk
    if pad:
        x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], 1)
    return x.movedim(2, 1)


def to_sequences(ctx: Ctx, q, k, v, g, beta, cu_seqlens):
    """Pack the user's layout into one padded row per sequence; valid [N, L] marks real tokens."""
    if cu_seqlens is not None:
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        L = ctx.call.max_len
        valid = torch.arange(L, device=q.device)[None, :] < lens[:, None]
    else:
        valid = None
    packed = [_pack(ctx, x, cu_seqlens, valid) for x in (q, k, v, g, beta)]
    return (*packed, valid)


def from_sequences(ctx: Ctx, out, valid):
    """[N, H, L, *] -> the user's [B, T, H, *]."""
    out = out.movedim(1, 2)
    if valid is None:
        return out[:, : ctx.call.q_len]
    return out[:, : valid.shape[1]][valid][None]


def initial(ctx: Ctx, s0, values):
    """The state entering the first chunk: the user's, or zeros [N, H, F, Vs]."""
    N, H, F = ctx.call.num_seqs, ctx.call.heads, ctx.call.feature_dim
    if s0 is None:
        return values.new_zeros(N, H, F, values.shape[-1])
    return s0.to(ctx.dtype)


def normalize_output(ctx: Ctx, o):
    """o [.., V+1] -> o[..., :V] / (z·q + eps)."""
    return o[..., :-1] / (o[..., -1:] + NORM_EPS)


# --------------------------------------------------------------------------- recurrent

def token_scan(ctx: Ctx, qs, ks, vs, gs, bs, s0):
    """The token loop: the literal recurrence, one step per token."""
    S = initial(ctx, s0, vs)
    outs = []
    delta = ctx.spec.update == "delta"
    for t in range(qs.shape[2]):
        q_t, k_t, v_t = qs[:, :, t], ks[:, :, t], vs[:, :, t]
        # S <- a_t S, then the additive write k v^T or the delta rule's beta k (v - S^T k)^T
        S = S * torch.exp(gs[:, :, t])[..., None]
        if delta:
            w_t = bs[:, :, t][..., None] * (v_t - (k_t[..., None, :] @ S)[..., 0, :])
        else:
            w_t = v_t
        S = S + k_t[..., :, None] * w_t[..., None, :]
        outs.append((q_t[..., None, :] @ S)[..., 0, :])
    return torch.stack(outs, 2), S


# --------------------------------------------------------------------------- chunked / parallel

def _chunks(ctx: Ctx, x):
    N, H, L = x.shape[:3]
    return x.reshape(N, H, L // ctx.chunk, ctx.chunk, *x.shape[3:])


def chunk_decay(ctx: Ctx, gs):
    """Cumulative log decay inside each chunk, float64 [N, H, n, C, Fg] (differences of it
    stay exact at long chunks and strong decays)."""
    return _chunks(ctx, gs).to(torch.float64).cumsum(-2)


def decayed_scores(x, y, G, strict: bool):
    """[.., C, F] x [.., C, F] -> [.., C, C]: x_t·diag(exp(G_t - G_i)) y_i for i <= t (i < t if strict)."""
    C = x.shape[-2]
    keep = torch.ones(C, C, dtype=torch.bool, device=x.device).tril(-1 if strict else 0)
    diff = G[..., :, None, :] - G[..., None, :, :]
    ratio = torch.where(keep[..., None], diff, float("-inf")).exp().to(x.dtype)
    if G.shape[-1] == 1:
        return (x @ y.transpose(-1, -2)) * ratio[..., 0]
    return torch.einsum("...tf,...if,...tif->...ti", x, y, ratio)


def intra_chunk(ctx: Ctx, qs, ks, G):
    """P [N, H, n, C, C]: decayed causal scores of queries on keys inside each chunk."""
    return decayed_scores(_chunks(ctx, qs), _chunks(ctx, ks), G, strict=False)


def ut_transform(ctx: Ctx, ks, vs, bs, G):
    """The WY/UT transform of the delta rule per chunk: W [.., C, F], U [.., C, Vs]
    from (I + A) X = rhs, solved by triangular substitution, not inverted."""
    k, b = _chunks(ctx, ks), _chunks(ctx, bs)[..., None]
    A = decayed_scores(k, k, G, strict=True) * b
    T = A + torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    W = solve_triangular(T, b * k * G.exp().to(k.dtype), upper=False, unitriangular=True)
    U = solve_triangular(T, b * _chunks(ctx, vs), upper=False, unitriangular=True)
    return W, U


def state_scan(ctx: Ctx, qs, ks, values, G, P, s0, W=None):
    """The inter-chunk scan: per chunk, new values (U - W S for delta), outputs
    (Q ⊙ Γ) S + P U, and the state passed on, Γ_C S + (K ⊙ Γ_C/Γ)^T U."""
    q, k = _chunks(ctx, qs), _chunks(ctx, ks)
    U = values if values.dim() == 5 else _chunks(ctx, values)
    G_last = G[..., -1:, :]
    q_dec = q * G.exp().to(q.dtype)
    k_dec = k * (G_last - G).exp().to(k.dtype)
    state_dec = G_last.exp().to(q.dtype).transpose(-1, -2)          # [N, H, n, Fg, 1]
    S = initial(ctx, s0, U)
    outs = []
    for c in range(q.shape[2]):
        u = U[:, :, c] if W is None else U[:, :, c] - W[:, :, c] @ S
        outs.append(q_dec[:, :, c] @ S + P[:, :, c] @ u)
        S = S * state_dec[:, :, c] + k_dec[:, :, c].transpose(-1, -2) @ u
    o = torch.stack(outs, 2)
    return o.reshape(*o.shape[:2], -1, o.shape[-1]), S


# --------------------------------------------------------------------------- bidirectional

def global_state(ctx: Ctx, ks, vs, s0):
    """S_T = S0 + K^T V over the whole sequence (padding rows are zero)."""
    return initial(ctx, s0, vs) + ks.transpose(-1, -2) @ vs


def readout(ctx: Ctx, qs, S):
    return qs @ S


# --------------------------------------------------------------------------- softmax

def share_kv_heads(ctx: Ctx, ks, vs):
    """Grouped-query attention: [N, H_kv, L, *] keys and values -> [N, H, L, *], query head h
    reading key / value head h // (H / H_kv)."""
    return repeat_heads(ctx.call.heads // ctx.call.kv_heads, 1, ks, vs)


SOFTMAX_QUERY_BLOCK = 1024  # queries per block: bounds the [block, keys] score tile


def visible_keys(spec: Spec, p_lo: int, p_hi: int, Tk: int) -> tuple[int, int]:
    """The keys [lo, hi) that some query at key positions p_lo..p_hi may attend to."""
    if spec.mask == "bidirectional":
        return 0, Tk
    lo = max(p_lo - spec.window + 1, 0) if spec.mask == "sliding_window" else 0
    return lo, min(p_hi + 1, Tk)


def softmax_with_lse(s):
    """[.., n] scores -> (softmax weights, natural-log log-sum-exp [..]). The row max is a
    constant of the rows (detached): the weights and lse do not depend on it, and differentiate
    as softmax and logsumexp do (d lse / d s = the weights)."""
    m = s.detach().amax(-1, keepdim=True)
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    return e / total, (m + torch.log(total))[..., 0]


def softmax_attend(ctx: Ctx, qs, ks, vs, gs, valid):
    """Masked softmax attention per query block, over the keys the block can see (O(T^2)
    work, O(T * block) memory); queries align to the end of the keys. Returns the outputs
    [N, H, Tq, V] and each query's log-sum-exp [N, H, Tq]."""
    spec, Tk = ctx.spec, ks.shape[2]
    Tq = qs.shape[2] if valid is not None else ctx.call.q_len
    qs = qs[:, :, :Tq]
    G = None if gs is None else floor_log_decay(gs.to(torch.float64)).cumsum(-1)    # [N, H, Tk]
    outs, lses = [], []
    for start in range(0, Tq, SOFTMAX_QUERY_BLOCK):
        end = min(start + SOFTMAX_QUERY_BLOCK, Tq)
        lo, hi = visible_keys(spec, start + Tk - Tq, end - 1 + Tk - Tq, Tk)
        s = ctx.call.scale * qs[:, :, start:end] @ ks[:, :, lo:hi].transpose(-1, -2)
        # [block, 1] key position of each query, [1, hi - lo] the keys
        pos = torch.arange(start, end, device=qs.device)[:, None] + (Tk - Tq)
        j = torch.arange(lo, hi, device=qs.device)[None, :]
        if G is not None:
            s = s + (G[..., pos] - G[..., None, lo:hi]).to(s.dtype)
        allowed = torch.ones_like(j, dtype=torch.bool) if spec.mask == "bidirectional" else j <= pos
        if spec.mask == "sliding_window":
            allowed = allowed & (j > pos - spec.window)
        if valid is not None:
            allowed = allowed & valid[:, None, None, lo:hi]
        # A finite floor, not -inf: padded query rows may see no key; they are dropped later.
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
        p, lse = softmax_with_lse(s)
        outs.append(p @ vs[:, :, lo:hi])
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)
