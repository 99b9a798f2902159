"""Serving (README.md, "Serving"): a per-layer state cache indexed by request slot, the checks of
a call on it, and a decode step prepared once for fixed shapes.

Continuous batching: each request owns a slot of every layer's cache for its lifetime. A prefill
or decode call passes the cache and one slot index per sequence of the call; the kernels read each
sequence's initial state from its slot and write its final state back there, in place (no
gather or scatter in PyTorch). A slot of -1 marks a padding entry of a batch (a CUDA graph
captured for more sequences than are running): its state is neither read nor written.
"""
from __future__ import annotations

import numbers

import torch

from .inputs import Call, check_linear, validate_values
from .spec import Spec

# The slot of a padding entry: its sequence runs from a zero state and nothing is stored.
PAD_SLOT = -1
_SLOT_DTYPES = (torch.int32, torch.int64)


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


class StateCache:
    """One layer's serving state: for a linear op, the recurrent state of every request slot,
    `state` [slots, H, F, VS] (F = K, or the FAVOR+ feature count; VS = V, or V + 1 with normalize
    sum, the last column the normalizer), float32 (float64 for float64 inputs, which run the
    PyTorch forms). Slots start at zero; `reset(slots)` zeroes them for new requests."""

    def __init__(self, op, slots: int, heads: int, head_dim: int, value_dim: int, device=None,
                 dtype: torch.dtype = torch.float32):
        spec = getattr(op, "spec", None)
        if not isinstance(spec, Spec):
            raise ValueError(f"op: expected an attngen op (attngen.load), got {type(op).__name__}")
        if not spec.is_linear:
            raise ValueError(f"op: spec {spec.name!r} has attention: softmax; a StateCache holds the states of "
                             "attention: linear ops")
        if spec.mask == "bidirectional":
            raise ValueError(f"op: spec {spec.name!r} has mask: bidirectional, whose outputs read the whole "
                             "sequence: it cannot be served token by token; allowed: causal linear specs")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype: expected torch.float32 (or torch.float64, for float64 inputs), got {dtype}")
        self.spec = spec
        self.num_slots = _positive("slots", slots)
        self.heads = _positive("heads", heads)
        self.head_dim = _positive("head_dim", head_dim)
        self.value_dim = _positive("value_dim", value_dim)
        self.feature_dim = spec.feature_dim(self.head_dim)
        self.state_dim = self.value_dim + 1 if spec.normalize == "sum" else self.value_dim
        self.state = torch.zeros(self.num_slots, self.heads, self.feature_dim, self.state_dim, dtype=dtype,
                                 device=device)

    def __repr__(self) -> str:
        return (f"attngen.StateCache({self.spec.name}: state [{', '.join(map(str, self.state.shape))}] "
                f"{self.state.dtype} on {self.state.device})")

    def reset(self, slots) -> None:
        """Zero the states of these slots (an int, a sequence of ints or an integer tensor): the
        initial state of the requests that take them."""
        index = torch.as_tensor(slots, device=self.state.device).reshape(-1).to(torch.int64)
        self.state.index_fill_(0, index, 0.0)


def check_cache(spec: Spec, call: Call, q: torch.Tensor, cache, slots) -> None:
    """The shape, dtype and device checks of a call on a cache (no device sync): the cache is this
    spec's and fits the call, slots is an int32 / int64 tensor [N] on q's device."""
    if not isinstance(cache, StateCache):
        raise ValueError(f"cache: expected an attngen.StateCache, got {type(cache).__name__}")
    if cache.spec is not spec and cache.spec != spec:
        raise ValueError(f"cache: made for spec {cache.spec.name!r} (hash {cache.spec.hash}), but this op's spec "
                         f"is {spec.name!r} (hash {spec.hash}); allowed: a cache made for this op")
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
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in _SLOT_DTYPES:
        got = f"{list(slots.shape)} {slots.dtype}" if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise ValueError(f"slots: expected a 1-D int32 or int64 tensor [N] (one cache slot per sequence), got {got}")
    if slots.numel() != call.num_seqs:
        raise ValueError(f"slots: expected one slot per sequence, N = {call.num_seqs}, got {slots.numel()}")
    if slots.device != q.device:
        raise ValueError(f"slots: expected device {q.device} (that of q), got {slots.device}")


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


class DecodeStep:
    """A decode (or few-token) call of a linear op on a StateCache, prepared for fixed shapes:
    step(q, k, v, g=None, beta=None, *, slots) with q, k [N, T, H, K], v [N, T, H, V] contiguous
    (g, beta as for the op) -> `out` [N, T, H, V], the same tensor every call. The checks, the
    plan and the launch configuration are done once here; on the kernels a call compares the
    inputs' shapes, dtypes and contiguity with the prepared ones (host metadata, about a
    microsecond: a mismatch would read the wrong elements) and launches the token loop (no host
    sync, no allocation: capturable in a CUDA graph). ATTNGEN_VALIDATE=1 when the step is
    prepared makes each call check everything, the slot values too (a host sync)."""

    def __init__(self, op, cache: StateCache, batch: int, tokens: int, dtype: torch.dtype, scale, module,
                 validate: bool):
        spec = op.spec
        self.batch, self.tokens = _positive("batch", batch), _positive("tokens", tokens)
        if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise ValueError(f"dtype: expected float16, bfloat16, float32 or float64, got {dtype}")
        if not isinstance(cache, StateCache):
            raise ValueError(f"cache: expected an attngen.StateCache, got {type(cache).__name__}")
        self.op, self.cache, self.dtype, self.validate = op, cache, dtype, validate
        N, T, H, K, V = self.batch, self.tokens, cache.heads, cache.head_dim, cache.value_dim
        device = cache.state.device
        self.shapes = {"q": (N, T, H, K), "k": (N, T, H, K), "v": (N, T, H, V)}
        if spec.decay != "none":
            self.shapes["g"] = {"constant": (H,), "scalar": (N, T, H), "vector": (N, T, H, K)}[spec.decay]
        if spec.update == "delta":
            self.shapes["beta"] = (N, T, H)
        # the checks of a call, once, on (meta) inputs of the prepared shapes
        probe = {n: torch.empty(s, dtype=dtype if n in ("q", "k", "v") else torch.float32, device="meta")
                 for n, s in self.shapes.items()}
        call = check_linear(spec, **probe, scale=scale)
        check_cache(spec, call, torch.empty(0, dtype=dtype, device=device), cache,
                    torch.empty(N, dtype=torch.int32, device=device))
        self.scale = call.scale
        self._sq, self._sv = torch.Size(self.shapes["q"]), torch.Size(self.shapes["v"])
        self._sg = torch.Size(self.shapes["g"]) if "g" in self.shapes else None
        self._sb = torch.Size(self.shapes["beta"]) if "beta" in self.shapes else None
        self._sn = torch.Size((N,))
        self.out = torch.empty(N, T, H, V, dtype=dtype, device=device)
        self._run = None
        if module is not None:
            self._omega = op.features(K, device, torch.float32)
            self._run = module.recurrent_launch(N, T, H, K, V, cache.feature_dim, N, False, True, True, True)

    def __call__(self, q, k, v, g=None, beta=None, *, slots):
        dtype, sq = self.dtype, self._sq
        if self.validate or not (
                q.shape == sq and k.shape == sq and v.shape == self._sv and slots.shape == self._sn
                and q.dtype == dtype and k.dtype == dtype and v.dtype == dtype
                and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
                and (g is None if self._sg is None else g is not None and g.shape == self._sg and g.is_contiguous())
                and (beta is None if self._sb is None else
                     beta is not None and beta.shape == self._sb and beta.is_contiguous())):
            # the full checks name what differs
            self.check(q, k, v, g, beta, slots)
        if self._run is None:
            o, _ = self.op(q, k, v, g, beta, scale=self.scale, cache=self.cache, slots=slots, form="recurrent")
            return o
        state = self.cache.state
        self._run(q, k, v, g, beta, self._omega, state, self.out, state, None, slots, self.cache.num_slots,
                  self.scale)
        return self.out

    def check(self, q, k, v, g, beta, slots) -> None:
        """Everything a call of this step assumes: the op's checks of its inputs and of the cache,
        the prepared shapes and dtype, contiguous inputs, the slot values."""
        spec = self.op.spec
        call = check_linear(spec, q, k, v, g, beta, self.scale)
        check_cache(spec, call, q, self.cache, slots)
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            if t is None:
                continue
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
