"""Serving (README.md, "Serving"): a per-layer cache indexed by request slot (a linear op's
recurrent states, a softmax op's keys and values), the checks of a call on it, and a decode step
prepared once for fixed shapes.

Continuous batching: each request owns a slot of every layer's cache for its lifetime. A prefill
or decode call passes the cache and one slot index per sequence of the call; the kernels read each
sequence's initial state from its slot and write its final state back there (or append its keys
and values and attend to the slot's), in place (no gather or scatter in PyTorch). A slot of -1
marks a padding entry of a batch (a CUDA graph captured for more sequences than are running):
nothing of its slot is read or written.
"""
from __future__ import annotations

import math
import numbers

import torch

from .inputs import _FLOATS, Call, check_linear, check_softmax, no_cuda, validate_values
from .signature import softmax_cached
from .spec import LOG_DECAY_FLOOR, Spec

# The slot of a padding entry: its sequence runs from a zero state and nothing is stored.
PAD_SLOT = -1
_SLOT_DTYPES = (torch.int32, torch.int64)


def _device(device) -> torch.device | None:
    """StateCache's device, checked before anything is allocated on it: torch would fail deep in its
    lazy CUDA init (an AssertionError) where it cannot run CUDA."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        why = f" ({e})" if isinstance(e, RuntimeError) else ""
        raise ValueError(f"device: expected a torch.device or a device string ('cpu', 'cuda', 'cuda:1'), got "
                         f"{device!r}{why}") from None
    if device.type == "cuda":
        why = no_cuda()
        if why is None and device.index is not None and device.index >= torch.cuda.device_count():
            why = f"torch sees {torch.cuda.device_count()} CUDA device(s)"
        if why:
            raise ValueError(f"device: {device}, but {why}; allowed: a device torch can run here")
    return device


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


# Tokens one call may append to a sliding-window cache by default (StateCache's max_piece).
DEFAULT_MAX_PIECE = 64

# A softmax cache with decay keeps G, the cumulative log decay, in log2 units: the kernels' scores are
# in log2 units (exp2 is their softmax's exponential).
LOG2E = math.log2(math.e)


class StateCache:
    """One layer's serving state, by request slot. A linear op's: the recurrent state of every
    slot, `state` [slots, H, F, VS] (F = K, or the FAVOR+ feature count; VS = V, or V + 1 with
    normalize sum, the last column the normalizer), float32 (float64 for float64 inputs, which
    run the PyTorch forms). A softmax op's: the keys and values of every slot, `k` [slots, L,
    H_kv, K] and `v` [slots, L, H_kv, V] in the inputs' dtype, and `lengths` [slots] int32, the
    tokens each slot has seen; key position p sits at row p % L. Causal attention keeps every key
    (L = max_len, the most tokens a request holds); a sliding window of w keeps the last
    L = w + max_piece - 1 (a ring: a call of at most max_piece tokens still finds the keys its
    first query needs), or max_len if smaller. With scalar decay (forgetting attention) also `g_hi`,
    `g_lo` [slots, L, H] (H = query_heads, default heads: the log decays are per query head): each
    key position's G, the sum of its request's log decays up to it (floored as the kernels floor
    them; log2 units), as a float pair g_hi + g_lo (float32; float64 and zeros for float64 caches),
    position p at row p % L: a query at position t weighs key j by exp(G_t - G_j), so the cached keys
    need theirs. `reset(slots)` empties slots for new requests."""

    def __init__(self, op, slots: int, heads: int, head_dim: int, value_dim: int, device=None,
                 dtype: torch.dtype = torch.float32, *, max_len: int | None = None, max_piece: int | None = None,
                 query_heads: int | None = None):
        spec = getattr(op, "spec", None)
        if not isinstance(spec, Spec):
            raise ValueError(f"op: expected an attngen op (attngen.load), got {type(op).__name__}")
        if spec.mask == "bidirectional":
            raise ValueError(f"op: spec {spec.name!r} has mask: bidirectional, whose outputs read the whole "
                             "sequence: it cannot be served token by token; allowed: causal specs")
        if query_heads is not None and (spec.is_linear or spec.decay == "none"):
            raise ValueError(f"query_heads: only a softmax cache with decay keeps per query head log decays; spec "
                             f"{spec.name!r} takes none (got {query_heads!r})")
        self.spec = spec
        self.num_slots = _positive("slots", slots)
        self.heads = _positive("heads", heads)
        self.head_dim = _positive("head_dim", head_dim)
        self.value_dim = _positive("value_dim", value_dim)
        device = _device(device)
        if spec.is_linear:
            if max_len is not None or max_piece is not None:
                raise ValueError("max_len, max_piece: a linear op's state does not grow with the tokens; pass neither")
            if dtype not in (torch.float32, torch.float64):
                raise ValueError(f"dtype: expected torch.float32 (or torch.float64, for float64 inputs), got {dtype}")
            self.feature_dim = spec.feature_dim(self.head_dim)
            self.state_dim = self.value_dim + 1 if spec.normalize == "sum" else self.value_dim
            self.state = torch.zeros(self.num_slots, self.heads, self.feature_dim, self.state_dim, dtype=dtype,
                                     device=device)
            return
        if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise ValueError(f"dtype: expected the inputs' floating dtype (float16, bfloat16, float32, float64), "
                             f"got {dtype}")
        if spec.mask == "sliding_window":
            piece = DEFAULT_MAX_PIECE if max_piece is None else _positive("max_piece", max_piece)
            rows = spec.window + piece - 1
            self.capacity = min(rows, _positive("max_len", max_len)) if max_len is not None else rows
        else:
            if max_len is None:
                raise ValueError(f"max_len: a causal softmax cache keeps every key of a request, so it needs the "
                                 f"most tokens a request holds (spec {spec.name!r})")
            if max_piece is not None:
                raise ValueError("max_piece: only a sliding-window cache (a ring) takes it")
            self.capacity = _positive("max_len", max_len)
        shape = (self.num_slots, self.capacity, self.heads)
        self.k = torch.zeros(*shape, self.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(*shape, self.value_dim, dtype=dtype, device=device)
        self.lengths = torch.zeros(self.num_slots, dtype=torch.int32, device=device)
        self.query_heads = self.heads if query_heads is None else _positive("query_heads", query_heads)
        if self.query_heads % self.heads:
            raise ValueError(f"query_heads: the query heads H = {self.query_heads} must be a multiple of the cache's "
                             f"key / value heads H_kv = {self.heads} (grouped-query attention)")
        if spec.decay == "scalar":
            gates = torch.float64 if dtype == torch.float64 else torch.float32
            self.g_hi = torch.zeros(self.num_slots, self.capacity, self.query_heads, dtype=gates, device=device)
            self.g_lo = torch.zeros_like(self.g_hi)

    @property
    def wraps(self) -> bool:
        """Whether positions past the rows reuse them (a sliding window's ring of at least w rows)."""
        return self.spec.mask == "sliding_window" and self.capacity >= self.spec.window

    def __repr__(self) -> str:
        held = self.state if self.spec.is_linear else self.k
        what = "state" if self.spec.is_linear else "k"
        return (f"attngen.StateCache({self.spec.name}: {what} [{', '.join(map(str, held.shape))}] "
                f"{held.dtype} on {held.device})")

    def reset(self, slots) -> None:
        """Empty these slots (an int, a sequence of ints or an integer tensor) for the requests
        that take them: a zero state, or no keys."""
        held = self.state if self.spec.is_linear else self.lengths
        held.index_fill_(0, self._slot_index(slots).to(held.device), 0)

    def _slot_index(self, slots) -> torch.Tensor:
        """reset's slots as an int64 tensor, each checked: an integer in [0, slots) (no bool, float or
        negative index: torch would take a float's integer part and a negative index from the end)."""
        allowed = f"allowed: an int, a sequence of ints or an integer tensor, each in [0, {self.num_slots})"
        if isinstance(slots, torch.Tensor):
            if slots.dtype == torch.bool or slots.dtype.is_floating_point or slots.dtype.is_complex:
                raise ValueError(f"slots: expected integer slots, got a tensor of {slots.dtype}; {allowed}")
            index = slots.detach().reshape(-1).to("cpu", torch.int64)
        else:
            items = list(slots) if isinstance(slots, (list, tuple, range)) else [slots]
            bad = [x for x in items if isinstance(x, bool) or not isinstance(x, numbers.Integral)]
            if bad:
                raise ValueError(f"slots: expected integer slots, got {slots!r}; {allowed}")
            index = torch.tensor([int(x) for x in items], dtype=torch.int64)
        out = index[(index < 0) | (index >= self.num_slots)]
        if out.numel():
            raise ValueError(f"slots: slot {int(out[0])} is out of range for a cache of {self.num_slots} slots; {allowed}")
        return index


def check_cache(spec: Spec, call: Call, q: torch.Tensor, cache, slots) -> None:
    """The shape, dtype and device checks of a call on a cache (no device sync): the cache is this
    spec's and fits the call, slots is an int32 / int64 tensor [N] on q's device."""
    if not isinstance(cache, StateCache):
        raise ValueError(f"cache: expected an attngen.StateCache, got {type(cache).__name__}")
    if cache.spec is not spec and cache.spec != spec:
        raise ValueError(f"cache: made for spec {cache.spec.name!r} (hash {cache.spec.hash}), but this op's spec "
                         f"is {spec.name!r} (hash {spec.hash}); allowed: a cache made for this op")
    if spec.is_linear:
        _check_state(spec, call, q, cache)
    else:
        _check_keys(spec, call, q, cache)
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in _SLOT_DTYPES:
        got = f"{list(slots.shape)} {slots.dtype}" if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise ValueError(f"slots: expected a 1-D int32 or int64 tensor [N] (one cache slot per sequence), got {got}")
    if slots.numel() != call.num_seqs:
        raise ValueError(f"slots: expected one slot per sequence, N = {call.num_seqs}, got {slots.numel()}")
    if slots.device != q.device:
        raise ValueError(f"slots: expected device {q.device} (that of q), got {slots.device}")


def _check_state(spec: Spec, call: Call, q: torch.Tensor, cache: StateCache) -> None:
    vs = call.value_dim + 1 if spec.normalize == "sum" else call.value_dim
    want = (call.heads, call.feature_dim, vs)
    if tuple(cache.state.shape[1:]) != want:
        got = ", ".join(map(str, cache.state.shape))
        raise ValueError(f"cache: holds states [slots, H, F, VS] = [{got}], but this call (q {list(q.shape)}, "
                         f"V = {call.value_dim}) needs [slots, {', '.join(map(str, want))}]")
    want_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if cache.state.dtype != want_dtype:
        raise ValueError(f"cache: holds {cache.state.dtype} states, but {q.dtype} inputs need {want_dtype} ones "
                         "(float64 states for float64 inputs, float32 for the others)")
    if cache.state.device != q.device:
        raise ValueError(f"cache: on device {cache.state.device}, expected {q.device} (that of q)")


def _check_keys(spec: Spec, call: Call, q: torch.Tensor, cache: StateCache) -> None:
    if call.k_len != call.q_len:
        raise ValueError(f"k: with a cache, k and v hold the new tokens' keys and values, one per query: expected "
                         f"Tk = Tq = {call.q_len}, got Tk = {call.k_len}")
    want = (call.kv_heads, call.head_dim, call.value_dim)
    got = (cache.heads, cache.head_dim, cache.value_dim)
    if got != want:
        raise ValueError(f"cache: holds keys [slots, L, H_kv, K] = [{cache.num_slots}, {cache.capacity}, {got[0]}, "
                         f"{got[1]}] and values of V = {got[2]}, but this call needs H_kv, K, V = {want}")
    if cache.k.dtype != q.dtype:
        raise ValueError(f"cache: holds {cache.k.dtype} keys, but the inputs are {q.dtype}")
    if cache.k.device != q.device:
        raise ValueError(f"cache: on device {cache.k.device}, expected {q.device} (that of q)")
    if spec.decay == "scalar" and cache.query_heads != call.heads:
        raise ValueError(f"cache: keeps the log decays of H = {cache.query_heads} query heads (its query_heads), but "
                         f"this call's q has H = {call.heads}")
    if cache.wraps and call.max_len > cache.capacity - spec.window + 1:
        most = cache.capacity - spec.window + 1
        raise ValueError(f"q: a sequence of {call.max_len} new tokens on a sliding-window cache of {cache.capacity} "
                         f"rows (window {spec.window}) would overwrite keys its first queries need; at most {most} "
                         "tokens per call (the cache's max_piece)")


def check_inference(**tensors) -> None:
    """A call on a cache writes the states in place, outside autograd: no input may need a gradient."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise ValueError(f"{name}: requires grad, but a call on a StateCache is inference only (its states "
                             "are written in place); run it under torch.no_grad() or torch.inference_mode()")


def validate_slots(slots: torch.Tensor, num_slots: int) -> None:
    """ATTNGEN_VALIDATE=1: every slot in [0, num_slots) or PAD_SLOT, no slot twice (one host read)."""
    values = slots.tolist()
    seen: set[int] = set()
    for n, slot in enumerate(values):
        if slot == PAD_SLOT:
            continue
        if not 0 <= slot < num_slots:
            raise ValueError(f"slots: slot {slot} at [{n}] is out of range; allowed: 0 .. {num_slots - 1} "
                             f"(the cache's slots), or {PAD_SLOT} for a padding entry")
        if slot in seen:
            raise ValueError(f"slots: slot {slot} at [{n}] appears twice; each sequence of a call needs a slot "
                             "of its own")
        seen.add(slot)


def validate_room(cache: StateCache, slots: torch.Tensor, lengths: list[int]) -> None:
    """ATTNGEN_VALIDATE=1 on a softmax cache whose rows do not wrap: each slot has room for its
    sequence's new tokens (one host read of the slots' lengths)."""
    if cache.wraps:
        return
    held = cache.lengths.tolist()
    for n, (slot, new) in enumerate(zip(slots.tolist(), lengths)):
        if slot != PAD_SLOT and held[slot] + new > cache.capacity:
            raise ValueError(f"slots: slot {slot} at [{n}] holds {held[slot]} tokens; {new} more exceed its "
                             f"{cache.capacity} rows (the cache's max_len)")


def run_torch(run, cache: StateCache, slots: torch.Tensor):
    """A call on a cache through the PyTorch forms: run(initial_state) -> (o, final_state) with each
    sequence's state gathered from its slot (zero for padding), the final states stored back."""
    rows = slots.to(torch.int64)
    valid = (rows >= 0) & (rows < cache.num_slots)
    s0 = cache.state[rows.clamp(0, cache.num_slots - 1)]
    s0 = torch.where(valid[:, None, None, None], s0, torch.zeros((), dtype=s0.dtype, device=s0.device))
    with torch.no_grad():
        o, ht = run(s0)
        cache.state[rows[valid]] = ht[valid].to(cache.state.dtype)
    return o


def run_torch_keys(attend, cache: StateCache, slots: torch.Tensor, q, k, v, cu_seqlens, g=None):
    """A call on a softmax cache through the PyTorch forms, one sequence at a time: its queries
    attend (attend(q, k, v, g) -> o) to the keys its slot holds and its new ones, which are then
    stored at their rows and its length advanced; a padding entry's outputs are zero. With decay,
    g [B, T, H] the new positions' log decays: the held keys' g are the differences of their G (the
    first's is any: a query's weights depend on the decays after a key only), and the new positions'
    G continue the slot's."""
    cu = cu_seqlens.tolist() if cu_seqlens is not None else None
    held = cache.lengths.tolist()
    outs = []
    with torch.no_grad():
        for n, slot in enumerate(slots.tolist()):
            rows = (slice(n, n + 1),) if cu is None else (slice(0, 1), slice(cu[n], cu[n + 1]))
            q_n, k_n, v_n = q[rows], k[rows], v[rows]
            if not 0 <= slot < cache.num_slots:
                outs.append(v_n.new_zeros(*q_n.shape[:3], v_n.shape[-1]))
                continue
            start, new = held[slot], k_n.shape[1]
            # the positions the slot still holds, then the new ones, at their rows p % L
            kept = torch.arange(start - min(start, cache.capacity), start, device=q.device) % cache.capacity
            fresh = torch.arange(start, start + new, device=q.device) % cache.capacity
            g_all = None
            if g is not None:
                # [kept, H] the held positions' G (natural log units), float64
                G = (cache.g_hi[slot, kept].to(torch.float64) + cache.g_lo[slot, kept].to(torch.float64)) / LOG2E
                g_all = torch.cat([torch.diff(G, dim=0, prepend=G[:1])[None].to(g.dtype), g[rows]], 1)
                g_new = g[rows][0].to(torch.float64).clamp(min=LOG_DECAY_FLOOR)
                G_new = (G[-1] if start else 0.0) + torch.cumsum(g_new, 0)
                G_hi = (G_new * LOG2E).to(cache.g_hi.dtype)
                cache.g_hi[slot, fresh] = G_hi
                cache.g_lo[slot, fresh] = (G_new * LOG2E - G_hi.to(torch.float64)).to(cache.g_lo.dtype)
            outs.append(attend(q_n, torch.cat([cache.k[slot, kept][None], k_n], 1),
                               torch.cat([cache.v[slot, kept][None], v_n], 1), g_all))
            cache.k[slot, fresh] = k_n[0]
            cache.v[slot, fresh] = v_n[0]
            cache.lengths[slot] = start + new
    return torch.cat(outs, 0 if cu is None else 1)


def cached_softmax_args(spec: Spec, cache: StateCache, q, k, v, g, slots, cu_seqlens, scale, max_len, launch) -> tuple:
    """The arguments of a softmax op's serving call on `cache` (the generated cached_forward and
    cached_op), in their order: with scalar decay also the new positions' log decays g and the
    cache's G pairs."""
    values = dict(q=q, k=k, v=v, k_cache=cache.k, v_cache=cache.v, kv_lens=cache.lengths, kv_slots=slots,
                  cu_seqlens=cu_seqlens, scale=scale, max_len=max_len, launch=launch)
    if spec.decay == "scalar":
        values.update(g=g, g_hi=cache.g_hi, g_lo=cache.g_lo)
    return softmax_cached(spec.decay).bind(**values)


class DecodeStep:
    """A decode (or few-token) call on a StateCache, prepared for fixed shapes: step(q, k, v,
    g=None, beta=None, *, slots) with q [N, T, H, K], k [N, T, H (softmax: H_kv), K], v [N, T, H
    (softmax: H_kv; linear: HV), V] contiguous (g, beta as for the op) -> o [N, T, H (linear: HV),
    V]. The checks, the plan and the launch configuration are done once here; on the kernels a call
    compares the inputs' shapes, dtypes, devices and contiguity with the prepared ones and slots'
    integer dtype (host metadata, a few microseconds: a mismatch would read the wrong elements) and
    launches the kernels, with no host sync: capturable in a CUDA graph. A linear op's step launches
    the token loop alone and returns `out`, the same tensor every call (no allocation); a softmax
    op's appends the keys and attends (flash-decoding) and returns its output, also the same tensor
    every call (it and the split partials allocated here).
    ATTNGEN_VALIDATE=1 when the step is prepared makes each call check everything, the slot
    values too (a host sync)."""

    def __init__(self, op, cache: StateCache, batch: int, tokens: int, dtype: torch.dtype, scale, module,
                 validate: bool, heads: int | None = None):
        spec = op.spec
        self.batch, self.tokens = _positive("batch", batch), _positive("tokens", tokens)
        if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise ValueError(f"dtype: expected float16, bfloat16, float32 or float64, got {dtype}")
        if not isinstance(cache, StateCache):
            raise ValueError(f"cache: expected an attngen.StateCache, got {type(cache).__name__}")
        self.op, self.cache, self.dtype, self.validate = op, cache, dtype, validate
        N, T, HC, K, V = self.batch, self.tokens, cache.heads, cache.head_dim, cache.value_dim
        # the query heads: softmax H, a multiple of the cache's H_kv; linear H, dividing the cache's
        # (value) heads HV (grouped value heads); both default to the cache's heads
        H = HC if heads is None else _positive("heads", heads)
        if spec.is_linear and HC % H:
            raise ValueError(f"heads: the query / key heads H = {H} must divide the cache's value heads HV = {HC} "
                             "(grouped value heads: HV // H value heads share a query / key head)")
        held = cache.state if spec.is_linear else cache.k
        device = self.device = held.device
        if spec.is_linear:
            # g, beta and the state are per value head
            self.shapes = {"q": (N, T, H, K), "k": (N, T, H, K), "v": (N, T, HC, V)}
            HG = HC
        else:
            self.shapes = {"q": (N, T, H, K), "k": (N, T, HC, K), "v": (N, T, HC, V)}
            HG = H
        if spec.decay != "none":
            self.shapes["g"] = {"constant": (HG,), "scalar": (N, T, HG), "vector": (N, T, HG, K)}[spec.decay]
        if spec.rule.takes_beta:
            self.shapes["beta"] = (N, T, HG)
        # the checks of a call, once, on (meta) inputs of the prepared shapes
        probe = {n: torch.empty(s, dtype=dtype if n in ("q", "k", "v") else torch.float32, device="meta")
                 for n, s in self.shapes.items()}
        call = self._check_inputs(probe, scale)
        check_cache(spec, call, torch.empty(0, dtype=dtype, device=device), cache,
                    torch.empty(N, dtype=torch.int32, device=device))
        self.scale = call.scale
        self._sq, self._sk, self._sv = (torch.Size(self.shapes[n]) for n in ("q", "k", "v"))
        self._sg = torch.Size(self.shapes["g"]) if "g" in self.shapes else None
        self._sb = torch.Size(self.shapes["beta"]) if "beta" in self.shapes else None
        self._sn = torch.Size((N,))
        self.out = torch.empty(N, T, HC, V, dtype=dtype, device=device) if spec.is_linear else None
        self._run = None
        if module is not None and spec.is_linear:
            self._omega = op.features(K, device, torch.float32)
            self._run = module.recurrent_launch(N, T, HC, K, V, cache.feature_dim, N, False, True, True, True, HC // H)
        elif module is not None:
            # the kernels' launches fixed once on tensors of the step's shapes (their values unread)
            like = {n: torch.empty(s, dtype=dtype if n in ("q", "k", "v") else torch.float32, device=device)
                    for n, s in self.shapes.items()}
            launch = op.cache_launch(call, cache.k.shape[1], device, dtype)
            slots = torch.empty(N, dtype=torch.int32, device=device)
            self._run = module.cached_launch(*cached_softmax_args(
                spec, cache, like["q"], like["k"], like["v"], like.get("g"), slots, None, self.scale, T, launch))

    def _check_inputs(self, inputs: dict, scale) -> Call:
        if self.op.spec.is_linear:
            return check_linear(self.op.spec, **inputs, scale=scale)
        if "beta" in inputs:
            raise ValueError("beta: softmax attention takes none (it is for attention: linear)")
        return check_softmax(self.op.spec, **inputs, scale=scale)

    def _prepared(self, q, k, v, g, beta, slots) -> bool:
        """Whether a call's inputs are those the step was prepared for, from host metadata alone:
        shapes, dtypes, devices and contiguity, slots an integer tensor, and no input that needs a
        gradient while autograd records."""
        dtype, device = self.dtype, self.device
        try:
            return (q.shape == self._sq and k.shape == self._sk and v.shape == self._sv and slots.shape == self._sn
                    and q.dtype == dtype and k.dtype == dtype and v.dtype == dtype and slots.dtype in _SLOT_DTYPES
                    and q.device == device and k.device == device and v.device == device and slots.device == device
                    and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
                    and (g is None if self._sg is None else g is not None and g.shape == self._sg
                         and g.dtype in _FLOATS and g.device == device and g.is_contiguous())
                    and (beta is None if self._sb is None else beta is not None and beta.shape == self._sb
                         and beta.dtype in _FLOATS and beta.device == device and beta.is_contiguous())
                    and not (torch.is_grad_enabled() and (
                        q.requires_grad or k.requires_grad or v.requires_grad
                        or (g is not None and g.requires_grad) or (beta is not None and beta.requires_grad))))
        except AttributeError:  # an input that is not a tensor
            return False

    def __call__(self, q, k, v, g=None, beta=None, *, slots):
        if self.validate or not self._prepared(q, k, v, g, beta, slots):
            # the full checks name what differs
            self.check(q, k, v, g, beta, slots)
        cache = self.cache
        if self._run is None:
            if self.op.spec.is_linear:
                return self.op(q, k, v, g, beta, scale=self.scale, cache=cache, slots=slots, form="recurrent")[0]
            return self.op(q, k, v, g, scale=self.scale, cache=cache, slots=slots)
        if self.out is None:
            return self._run(q, k, v, g, slots)
        state = cache.state
        self._run(q, k, v, g, beta, self._omega, state, self.out, state, None, slots, cache.num_slots, self.scale)
        return self.out

    def check(self, q, k, v, g, beta, slots) -> None:
        """Everything a call of this step assumes: the op's checks of its inputs and of the cache,
        the prepared shapes and dtype, contiguous inputs, the slot values."""
        spec = self.op.spec
        given = {n: t for n, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)) if t is not None}
        call = self._check_inputs(given, self.scale)
        check_cache(spec, call, q, self.cache, slots)
        for name, t in given.items():
            if tuple(t.shape) != self.shapes[name]:
                raise ValueError(f"{name}: this decode step was prepared for shape {list(self.shapes[name])}, "
                                 f"got {list(t.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous tensor (the step reads it in place), got strides "
                                 f"{t.stride()}")
        if q.dtype != self.dtype:
            raise ValueError(f"q: this decode step was prepared for {self.dtype}, got {q.dtype}")
        if slots.shape != self._sn:
            raise ValueError(f"slots: this decode step was prepared for [{self.batch}], got {list(slots.shape)}")
        check_inference(q=q, k=k, v=v, g=g, beta=beta)
        validate_values(q, k, v, g, beta)
        validate_slots(slots, self.cache.num_slots)
        if not spec.is_linear:
            validate_room(self.cache, slots, [self.tokens] * self.batch)
