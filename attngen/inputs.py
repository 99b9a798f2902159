"""Runtime input checks (DESIGN.md §2): shapes, dtypes, devices, g/beta presence, cu_seqlens.

Every problem is a ValueError that names the argument, what it got and what it expects.
The checked call is summarised in a frozen `Call` that the planner and the forms read.
"""
from __future__ import annotations

import dataclasses
import numbers
import os

import torch

from .spec import SCALE_MAX, Spec

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_OFFSETS = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True)
class Call:
    """The sizes of one checked call."""

    batch: int          # B (1 with cu_seqlens)
    q_len: int          # Tq
    k_len: int          # Tk (== Tq for linear attention)
    heads: int          # H: softmax the query heads; linear the value / state heads HV (H without grouping)
    head_dim: int       # K
    value_dim: int      # V
    feature_dim: int    # F
    num_seqs: int       # N: B, or the number of packed sequences
    max_len: int        # longest sequence (Tk, or the longest packed one)
    scale: float
    varlen: bool
    kv_heads: int       # key / value heads (softmax: H_kv dividing H; linear: heads)
    # linear: the q / k heads H dividing heads (grouped value heads: HV // H value heads share a q / k
    # head); softmax: heads. None (a call built without it): heads
    qk_heads: int | None = None

    def __post_init__(self):
        if self.qk_heads is None:
            object.__setattr__(self, "qk_heads", self.heads)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _tensor(name: str, t, rank: int, expect: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor of shape {expect}, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name}: expected shape {expect} ({rank} dims), got {_shape(t)}")
    if t.dtype not in _FLOATS:
        raise ValueError(f"{name}: expected a floating dtype (float16, bfloat16, float32, float64), got {t.dtype}")
    return t


def _head_first(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> str:
    """A hint when `got` is `want` with its time and head dims (1 and 2) swapped: a head-first
    tensor next to time-major ones. (All inputs head-first with dims that fit cannot be told
    from a time-major call: T and H are read swapped.)"""
    if len(got) < 3 or len(got) != len(want) or got == want or (got[0], got[2], got[1], *got[3:]) != want:
        return ""
    return (f", which looks head-first ([B, H, T, ...]: time and heads swapped); attngen takes the time-major "
            f"layout [B, T, H, ...]: use {name}.transpose(1, 2) (or transpose the others if they are the "
            "head-first ones)")


def no_cuda() -> str | None:
    """Why torch cannot run CUDA here, or None where it can."""
    if torch.cuda.is_available():
        return None
    return "this torch has no CUDA support (torch.version.cuda is None)" if torch.version.cuda is None \
        else "torch sees no CUDA device (torch.cuda.is_available() is False)"


def _device(name: str, t: torch.Tensor) -> None:
    """A CUDA tensor where torch cannot run CUDA would fail deep in torch (an AssertionError
    from its lazy CUDA init) or in a kernel launch; the other inputs must be on q's device."""
    why = no_cuda() if t.device.type == "cuda" else None
    if why:
        raise ValueError(f"{name}: a CUDA tensor ({t.device}), but {why}; allowed: CPU tensors here")


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], expect: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {expect} = [{', '.join(map(str, shape))}], got {_shape(t)}"
                         f"{_head_first(name, tuple(t.shape), shape)}")


def _same(name: str, t: torch.Tensor, ref: torch.Tensor, dtype: bool = True) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name}: expected device {ref.device} (that of q), got {t.device}")
    if dtype and t.dtype != ref.dtype:
        raise ValueError(f"{name}: expected dtype {ref.dtype} (that of q), got {t.dtype}")


def _scale(spec: Spec, scale, head_dim: int) -> float:
    if scale is None:
        return spec.default_scale(head_dim)
    try:
        value = float(scale) if isinstance(scale, numbers.Real) and not isinstance(scale, bool) else None
    except OverflowError:  # an int past float's range
        value = float("inf")
    if value is None or not 0 < value <= SCALE_MAX:
        raise ValueError(f"scale: expected a positive finite number (at most {SCALE_MAX:.4g}, float32's largest) "
                         f"or None, got {scale!r}")
    return value


def _sequences(cu_seqlens, q: torch.Tensor, batch: int, total: int) -> tuple[int, int]:
    """(N, longest sequence) of a call: the batch rows, or the checked packed sequences."""
    if cu_seqlens is None:
        return batch, total
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in _OFFSETS:
        got = f"{_shape(cu_seqlens)} {cu_seqlens.dtype}" if isinstance(cu_seqlens, torch.Tensor) \
            else type(cu_seqlens).__name__
        raise ValueError(f"cu_seqlens: expected a 1-D integer tensor [N + 1] of int32 or int64, got {got}")
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch size 1, got q of shape {_shape(q)}")
    if cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens: expected at least 2 entries [0, ..., T]")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens: expected device {q.device} (that of q), got {cu_seqlens.device}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"cu_seqlens: expected to start at 0 and end at T = {total}, got {cu[0]} ... {cu[-1]}")
    if any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: expected strictly increasing offsets, got {cu}")
    return len(cu) - 1, max(b - a for a, b in zip(cu, cu[1:]))


def packed_offsets(cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    """A checked cu_seqlens as every form and kernel gets it: contiguous. The kernels read
    offset n at address cu_seqlens + n, so a strided view (a slice with a step) would hand them
    the values in its gaps: sequences that are not the caller's, and out-of-bounds writes."""
    return cu_seqlens.contiguous() if cu_seqlens is not None else None


def check_linear(spec: Spec, q, k, v, g=None, beta=None, scale=None, initial_state=None, cu_seqlens=None) -> Call:
    q = _tensor("q", q, 4, "[B, T, H, K]")
    _device("q", q)
    B, T, H, K = q.shape
    _tensor("k", k, 4, "[B, T, H, K]")
    _expect("k", k, (B, T, H, K), "[B, T, H, K]")
    _same("k", k, q)
    _tensor("v", v, 4, "[B, T, HV, V]")
    HV = v.shape[2]
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v: expected shape [B, T, HV, V] = [{B}, {T}, HV, V], got {_shape(v)}"
                         f"{_head_first('v', tuple(v.shape[:3]), (B, T, H))}")
    if H and (HV == 0 or HV % H):
        raise ValueError(f"v: its heads HV = {HV} must be a multiple of the query / key heads H = {H} (grouped "
                         f"value heads: HV // H value heads share a query / key head); got v {_shape(v)}, "
                         f"q {_shape(q)}{_head_first('v', tuple(v.shape[:3]), (B, T, H))}")
    _same("v", v, q)
    V = v.shape[3]
    if T == 0 or K == 0 or V == 0 or H == 0 or B == 0:
        raise ValueError(f"q, v: expected non-empty tensors, got q {_shape(q)} and v {_shape(v)}")
    F = spec.feature_dim(K)

    # g, beta and the state are per value head
    if spec.decay == "none":
        if g is not None:
            raise ValueError(f"g: this spec has decay: none, so g must be None; got a tensor {_shape(g)}")
    else:
        expect = {"constant": ("[HV]", (HV,)), "scalar": ("[B, T, HV]", (B, T, HV)),
                  "vector": ("[B, T, HV, K]", (B, T, HV, K))}[spec.decay]
        if g is None:
            raise ValueError(f"g: this spec has decay: {spec.decay}, so g (log decay) of shape {expect[0]} is required")
        _tensor("g", g, len(expect[1]), expect[0])
        _expect("g", g, expect[1], expect[0])
        _same("g", g, q, dtype=False)
    if spec.rule.takes_beta:
        if beta is None:
            raise ValueError(f"beta: this spec has update: {spec.update}, so beta of shape [B, T, HV] is required")
        _tensor("beta", beta, 3, "[B, T, HV]")
        _expect("beta", beta, (B, T, HV), "[B, T, HV]")
        _same("beta", beta, q, dtype=False)
    elif beta is not None:
        raise ValueError(f"beta: this spec has update: {spec.update}, so beta must be None; got a tensor {_shape(beta)}")

    varlen = cu_seqlens is not None
    N, max_len = _sequences(cu_seqlens, q, B, T)
    Vs = V + 1 if spec.normalize == "sum" else V
    if initial_state is not None:
        _tensor("initial_state", initial_state, 4, "[N, HV, F, V]")
        extra = " (V + 1 columns: the last holds the normalizer)" if Vs != V else ""
        _expect("initial_state", initial_state, (N, HV, F, Vs), f"[N, HV, F, V]{extra}")
        _same("initial_state", initial_state, q, dtype=False)
    return Call(B, T, T, HV, K, V, F, N, max_len, _scale(spec, scale, K), varlen, HV, H)


def check_softmax(spec: Spec, q, k, v, g=None, scale=None, cu_seqlens=None) -> Call:
    q = _tensor("q", q, 4, "[B, Tq, H, K]")
    _device("q", q)
    B, Tq, H, K = q.shape
    _tensor("k", k, 4, "[B, Tk, H_kv, K]")
    Tk, Hkv = k.shape[1], k.shape[2]
    if Hkv == 0 or H % Hkv:
        # k head-first, [B, H_kv, Tk, K], would have its heads in dim 1
        hint = _head_first("k", (B, Hkv, Tk), (B, Tk, Hkv)) if Tk and H % Tk == 0 else ""
        raise ValueError(f"k: its heads H_kv = {Hkv} must divide the query heads H = {H} (grouped-query "
                         f"attention: H // H_kv query heads share a key / value head); got k {_shape(k)}, "
                         f"q {_shape(q)}{hint}")
    _expect("k", k, (B, Tk, Hkv, K), "[B, Tk, H_kv, K]")
    _same("k", k, q)
    _tensor("v", v, 4, "[B, Tk, H_kv, V]")
    if tuple(v.shape[:3]) != (B, Tk, Hkv):
        raise ValueError(f"v: expected shape [B, Tk, H_kv, V] = [{B}, {Tk}, {Hkv}, V] (that of k), got {_shape(v)}"
                         f"{_head_first('v', tuple(v.shape[:3]), (B, Tk, Hkv))}")
    _same("v", v, q)
    V = v.shape[3]
    if min(B, Tq, H, K, V) == 0:
        raise ValueError(f"q, v: expected non-empty tensors, got q {_shape(q)} and v {_shape(v)}")
    if Tq > Tk:
        raise ValueError(f"q: expected Tq <= Tk (queries align to the end of the keys), got Tq = {Tq} > Tk = {Tk}")
    if spec.decay == "scalar":
        if g is None:
            raise ValueError("g: this spec has decay: scalar, so g (log decay) of shape [B, Tk, H] is required")
        _tensor("g", g, 3, "[B, Tk, H]")
        _expect("g", g, (B, Tk, H), "[B, Tk, H]")
        _same("g", g, q, dtype=False)
    elif g is not None:
        raise ValueError(f"g: this spec has decay: none, so g must be None; got a tensor {_shape(g)}")
    varlen = cu_seqlens is not None
    if varlen and Tq != Tk:
        raise ValueError(f"cu_seqlens: packed sequences need Tq == Tk, got Tq = {Tq}, Tk = {Tk}")
    N, max_len = _sequences(cu_seqlens, q, B, Tk)
    return Call(B, Tq, Tk, H, K, V, K, N, max_len, _scale(spec, scale, K), varlen, Hkv)


def validating() -> bool:
    """ATTNGEN_VALIDATE=1: check input values too (validate_values). Off by default: each check
    reads a reduction back to the host, a device sync on every call."""
    value = os.environ.get("ATTNGEN_VALIDATE", "0")
    if value not in ("0", "1"):
        raise ValueError(f"ATTNGEN_VALIDATE: value {value!r} is not allowed; allowed: 0 (default), 1")
    return value == "1"


def _where(t: torch.Tensor, flat: int) -> str:
    return "[" + ", ".join(str(int(i)) for i in torch.unravel_index(torch.tensor(flat), t.shape)) + "]"


def _finite(name: str, t: torch.Tensor | None, allow_neg_inf: bool = False) -> None:
    if t is None:
        return
    bad = torch.isnan(t) | (t == float("inf")) if allow_neg_inf else ~torch.isfinite(t)
    if bool(bad.any()):
        flat = int(bad.flatten().nonzero()[0])
        allowed = "finite values or -inf (a reset: gate 0)" if allow_neg_inf else "finite values"
        raise ValueError(f"{name}: expected {allowed}, got {t.flatten()[flat].item()} at {_where(t, flat)}")


# The delta rule's step: S <- S (I - beta k k^T) + ..., which contracts for unit-norm keys only
# while 0 <= beta <= 2 (the eigenvalue along k is 1 - beta).
BETA_RANGE = (0.0, 2.0)


def validate_values(q, k, v, g=None, beta=None, initial_state=None) -> None:
    """The value checks of ATTNGEN_VALIDATE=1, after the shape checks: q, k, v, beta and the
    initial state finite; g (log decay) NaN-free and <= 0, -inf allowed (a gate exp(g) = 0);
    beta in BETA_RANGE."""
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta), ("initial_state", initial_state)):
        _finite(name, t)
    _finite("g", g, allow_neg_inf=True)
    if g is not None:
        top = g.max()
        if bool(top > 0):
            flat = int(g.flatten().argmax())
            raise ValueError(f"g: log decay must be <= 0 (a gate exp(g) <= 1); got max {top.item():g} at "
                             f"{_where(g, flat)}")
    if beta is not None:
        lo, hi = BETA_RANGE
        bad = (beta < lo) | (beta > hi)
        if bool(bad.any()):
            flat = int(bad.flatten().nonzero()[0])
            raise ValueError(f"beta: expected values in [{lo:g}, {hi:g}] (the delta rule contracts the state for "
                             f"unit keys only there), got {beta.flatten()[flat].item():g} at {_where(beta, flat)}")
