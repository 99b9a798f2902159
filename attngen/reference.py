"""The naive interpreter: the literal float64 reading of DESIGN.md §3.

This is the oracle every form and kernel is held to. It loops over sequences and tokens
and does nothing clever; it is differentiable through torch autograd.
"""
from __future__ import annotations

import torch

from . import algebra
from .inputs import check_linear, check_softmax
from .spec import L2_EPS, LOG_DECAY_FLOOR, NORM_EPS, Spec, load_spec


def random_features(spec: Spec, head_dim: int, device=None, dtype=torch.float64) -> torch.Tensor | None:
    """FAVOR+ Omega [m, K] of a favor_plus spec (None otherwise)."""
    if spec.feature_map != "favor_plus":
        return None
    fp = spec.favor_plus
    omega = algebra.favor_random_features(fp.features, head_dim, fp.orthogonal, fp.seed)
    return omega.to(device=device, dtype=dtype)


def phi(spec: Spec, x: torch.Tensor, omega: torch.Tensor | None = None) -> torch.Tensor:
    """The feature map along the last dim: [..., K] -> [..., F]."""
    if spec.feature_map == "favor_plus":
        K = x.shape[-1]
        xs = x * K ** -0.25
        proj = xs @ omega.to(x.dtype).T
        return torch.exp(proj - 0.5 * (xs * xs).sum(-1, keepdim=True)) * omega.shape[0] ** -0.5
    return algebra.torch_function(algebra.feature_expr(spec.feature_map, spec.feature_expr))(x)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def featurize(spec: Spec, q: torch.Tensor, k: torch.Tensor, scale: float, omega=None):
    """q, k [..., K] -> q_hat, k_hat [..., F]: feature map, then l2 norm, then scale on q."""
    qh, kh = phi(spec, q, omega), phi(spec, k, omega)
    if spec.qk_norm == "l2":
        qh, kh = l2norm(qh), l2norm(kh)
    return qh * scale, kh


def _sequences(B: int, T: int, cu_seqlens):
    """(batch index, start, end) of every independent sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = cu_seqlens.tolist()
    return [(0, s, e) for s, e in zip(cu, cu[1:])]


def linear_step(spec: Spec, S, q_t, k_t, v_t, a_t, beta_t):
    """One token of the linear recurrence on a state S [..., F, Vs]; returns (S_t, S_t^T q_t).
    a_t is the decay factor, broadcastable to [..., F, 1]."""
    S = S * a_t
    if spec.update == "delta":
        S = S + beta_t[..., None, None] * k_t[..., :, None] * (v_t - (S * k_t[..., :, None]).sum(-2))[..., None, :]
    else:
        S = S + k_t[..., :, None] * v_t[..., None, :]
    return S, (S * q_t[..., :, None]).sum(-2)


def decay_factor(spec: Spec, g: torch.Tensor | None, b: int, t: int):
    """exp(g_t) for batch row b and token t, shaped to broadcast on a state [H, F, Vs]."""
    if spec.decay == "none":
        return 1.0
    if spec.decay == "constant":
        return torch.exp(g)[:, None, None]
    if spec.decay == "scalar":
        return torch.exp(g[b, t])[:, None, None]
    return torch.exp(g[b, t])[:, :, None]


def _linear(spec, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, dtype):
    call = check_linear(spec, q, k, v, g, beta, scale, initial_state, cu_seqlens)
    cast = lambda t: None if t is None else t.to(dtype)
    q, k, v, g, beta, initial_state = map(cast, (q, k, v, g, beta, initial_state))
    omega = random_features(spec, call.head_dim, q.device, dtype)
    # grouped value heads: value head h reads query / key head h // (HV / H)
    q, k = (t.repeat_interleave(call.heads // call.qk_heads, 2) for t in (q, k))
    qh, kh = featurize(spec, q, k, call.scale, omega)
    if spec.normalize == "sum":
        v = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    B, T, H, F, Vs = call.batch, call.q_len, call.heads, call.feature_dim, v.shape[-1]
    outs, finals = [], []
    for n, (b, start, end) in enumerate(_sequences(B, T, cu_seqlens)):
        S = initial_state[n] if initial_state is not None else q.new_zeros(H, F, Vs)
        o_seq = []
        for t in range(start, end):
            bt = beta[b, t] if beta is not None else None
            S, o_t = linear_step(spec, S, qh[b, t], kh[b, t], v[b, t], decay_factor(spec, g, b, t), bt)
            o_seq.append(o_t)
        if spec.mask == "bidirectional":  # every token reads the final state
            o_seq = [(S * qh[b, t][:, :, None]).sum(-2) for t in range(start, end)]
        outs.append(torch.stack(o_seq))
        finals.append(S)
    o = torch.cat(outs).reshape(B, T, H, Vs) if cu_seqlens is not None else torch.stack(outs)
    if spec.normalize == "sum":
        o = o[..., :-1] / (o[..., -1:] + NORM_EPS)
    return o, (torch.stack(finals) if output_final_state else None)


def softmax_allowed(spec: Spec, Tq: int, Tk: int, device=None) -> torch.Tensor:
    """[Tq, Tk] bool: may query t attend to key j (queries aligned to the end of the keys)."""
    pos = torch.arange(Tq, device=device)[:, None] + (Tk - Tq)
    j = torch.arange(Tk, device=device)[None, :]
    if spec.mask == "bidirectional":
        return torch.ones(Tq, Tk, dtype=torch.bool, device=device)
    allowed = j <= pos
    if spec.mask == "sliding_window":
        allowed &= j > pos - spec.window
    return allowed


def _softmax(spec, q, k, v, g, scale, cu_seqlens, dtype):
    """(o [B, Tq, H, V], lse [B, Tq, H]): the output and the natural-log log-sum-exp of each
    query's allowed scaled scores (decay bias included)."""
    call = check_softmax(spec, q, k, v, g, scale, cu_seqlens)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    # grouped-query attention: query head h reads key / value head h // (H / H_kv)
    k, v = (t.repeat_interleave(call.heads // call.kv_heads, 2) for t in (k, v))
    g = None if g is None else g.to(dtype)
    outs, lses = [], []
    for b, start, end in _sequences(call.batch, call.k_len, cu_seqlens):
        if cu_seqlens is None:
            qs, ks, vs = q[b], k[b], v[b]                       # [Tq, H, K], [Tk, H, K]
            gs = None if g is None else g[b]
        else:
            qs, ks, vs = q[0, start:end], k[0, start:end], v[0, start:end]
            gs = None if g is None else g[0, start:end]
        Tq, Tk = qs.shape[0], ks.shape[0]
        s = call.scale * torch.einsum("thk,jhk->htj", qs, ks)
        if gs is not None:
            # the sum of g over j+1..t as G_t - G_j, G the cumsum of g: a reset (g_i = -inf, a gate
            # of exactly 0) enters at the log-decay floor, where exp is exactly 0, so -inf - -inf
            # never arises (the difference of cumulative sums is also what plain float32 PyTorch
            # computes: the low-precision error scale of the tolerances)
            G = torch.cumsum(gs.clamp(min=LOG_DECAY_FLOOR), 0).T     # [H, Tk]: sum of g_1..g_j
            pos = torch.arange(Tq, device=q.device) + (Tk - Tq)
            s = s + G[:, pos, None] - G[:, None, :]
        s = s.masked_fill(~softmax_allowed(spec, Tq, Tk, q.device), float("-inf"))
        outs.append(torch.einsum("htj,jhv->thv", torch.softmax(s, -1), vs))
        lses.append(torch.logsumexp(s, -1).T)
    if cu_seqlens is not None:
        return torch.cat(outs)[None], torch.cat(lses)[None]
    return torch.stack(outs), torch.stack(lses)


def reference(spec, q, k, v, g=None, beta=None, scale=None, initial_state=None,
              output_final_state=False, cu_seqlens=None, dtype=torch.float64, return_lse=False):
    """The oracle with the runtime contract of DESIGN.md §2. Linear: (o, final_state);
    softmax: o, or (o, lse [B, Tq, H]) with return_lse. Computed and returned in `dtype`:
    float64 is the oracle; a lower precision gives the error scale of the same computation in
    plain PyTorch."""
    spec = load_spec(spec)
    if spec.is_linear:
        if return_lse:
            raise ValueError("return_lse: linear attention has no log-sum-exp (it is for attention: softmax)")
        return _linear(spec, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, dtype)
    if beta is not None or initial_state is not None or output_final_state:
        raise ValueError("beta, initial_state, output_final_state: softmax attention takes none of these")
    o, lse = _softmax(spec, q, k, v, g, scale, cu_seqlens, dtype)
    return (o, lse) if return_lse else o
