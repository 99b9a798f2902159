"""Context parallelism: sequences sharded along time across the ranks of a torch.distributed
process group (NCCL on GPUs, gloo on the CPU), forward and backward.

    cp = attngen.distributed.ContextParallel(attngen.load("specs/gated_deltanet.yaml"), group)
    o, final_state = cp(q, k, v, g, beta, initial_state=s0, output_final_state=True)

Rank r of R holds tokens [start_r, end_r) of the time axis, the shards in rank order: q, k, v,
g, beta are its slices [B, T_r, H, *] (a constant decay's g [H] is the same on every rank; its
gradient on each rank is that rank's part, to be summed as DDP sums parameters' gradients).
Without cu_seqlens every batch row is one sequence across all shards: rank 0 takes the initial
state [B, H, F, V], the last rank returns the final state. With cu_seqlens (B = 1, the offsets of
the whole call, the same tensor on every rank) a sequence may start on one rank and end on
another: each rank takes the initial states of the sequences that start in its shard and returns
the final states of those that end in it ([N_r, H, F, V], in order; the ranks' rows concatenated
are the single-process call's). Outputs are this shard's [B, T_r, H, V]; gradients flow back
through the exchange, so every input's gradient is the single-process call's on this shard.

What the ranks exchange is the planner's choice (planner.parallel, PARALLEL_METHODS): one
all-gather forward, its reduce-scatter backward (_Gather). Every rank must make the same calls
with the same shard lengths and cu_seqlens, as for any collective.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools

import torch
import torch.distributed as dist

from . import forms, planner
from .inputs import check_linear
from .runtime import Op, load

# torch 2.13 renamed the single-tensor collectives (the old names warn); the GPU machine's torch 2.11
# has only the old ones
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Gather(torch.autograd.Function):
    """Each x [*] on every rank -> [R, *], the ranks' x in rank order (an all-gather per x, in
    order); the backward sums each rank's slice of the gradients over the ranks back to it (a
    reduce-scatter per x, in the same order: one node, so every rank issues them alike)."""

    # flat buffers: gloo takes the ranks' tensors concatenated, not stacked

    @staticmethod
    def forward(ctx, group, count, *tensors):
        ctx.group, ctx.anchors = group, len(tensors) - count
        outs = []
        for x in tensors[:count]:
            out = x.new_empty(dist.get_world_size(group) * x.numel())
            _ALL_GATHER(out, x.contiguous().view(-1), group=group)
            outs.append(out.view(-1, *x.shape))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        outs = []
        for grad in grads:
            out = grad.new_empty(grad[0].numel())
            _REDUCE_SCATTER(out, grad.contiguous().view(-1), group=ctx.group)
            outs.append(out.view(grad.shape[1:]))
        return (None, None, *outs, *[None] * ctx.anchors)


def gather(*xs: torch.Tensor, group=None, anchors: tuple = ()) -> tuple[torch.Tensor, ...]:
    """Every rank's x stacked in rank order [R, *x.shape], for each x; differentiable (an
    all-gather forward, a reduce-scatter backward). The results take part in the backward
    whenever an x or an anchor (the call's inputs) requires grad: a rank may send a constant
    (zeros, where none of its pieces continues elsewhere) yet must join the backward's
    collective as the others do. Every rank's backward must reach the results: see `after`."""
    anchors = tuple(t for t in anchors if isinstance(t, torch.Tensor) and t.requires_grad)
    return _Gather.apply(group, len(xs), *xs, *anchors)


class _After(torch.autograd.Function):
    """The outputs unchanged, made to depend on gathered tensors with a zero gradient. A rank
    whose outputs do not read what it gathered (rank 0 of causal attention) still runs the
    gather's backward, a collective the other ranks wait on."""

    @staticmethod
    def forward(ctx, count, *tensors):
        ctx.gathered = [(t.shape, t.dtype, t.device) for t in tensors[count:]]
        return tuple(t.view_as(t) for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.gathered))


def after(outputs: tuple, gathered: tuple) -> tuple:
    """`outputs` (tensors or None) whose backward reaches `gathered` (see _After)."""
    present = [t for t in outputs if t is not None]
    tied = iter(_After.apply(len(present), *present, *gathered))
    return tuple(None if t is None else next(tied) for t in outputs)


@dataclasses.dataclass(frozen=True)
class Shard:
    """Where the ranks' tokens lie. Rank j holds [bounds[j], bounds[j + 1]) of the time axis;
    bounds is None where no shard length is known (unpacked linear calls need none). cu: the
    packed offsets of the whole call; None: every batch row is one sequence."""

    rank: int
    ranks: int
    bounds: tuple[int, ...] | None
    cu: tuple[int, ...] | None

    def _is_offset(self, position: int) -> bool:
        i = bisect.bisect_left(self.cu, position)
        return i < len(self.cu) and self.cu[i] == position

    def crosses_in(self, j: int) -> bool:
        """Rank j's first token continues a sequence begun on an earlier rank."""
        return j > 0 if self.cu is None else not self._is_offset(self.bounds[j])

    def crosses_out(self, j: int) -> bool:
        """Rank j's last token's sequence continues on a later rank."""
        return j < self.ranks - 1 if self.cu is None else not self._is_offset(self.bounds[j + 1])

    def offsets(self, j: int) -> tuple[int, ...]:
        """Packed: the pieces of sequences in rank j's shard, as offsets from its start."""
        a, b = self.bounds[j], self.bounds[j + 1]
        inner = self.cu[bisect.bisect_right(self.cu, a):bisect.bisect_left(self.cu, b)]
        return (0, *(c - a for c in inner), b - a)

    def pieces(self, j: int) -> int:
        return 1 if self.cu is None else len(self.offsets(j)) - 1

    def first_sequence(self, j: int) -> int:
        """Packed: the sequence of rank j's first token."""
        return bisect.bisect_right(self.cu, self.bounds[j]) - 1

    def carries(self, j: int) -> bool:
        """The state leaving rank j's shard depends on the state entering it: one piece, continued."""
        return self.crosses_in(j) and self.pieces(j) == 1


def _cut(x, lo: int, hi: int):
    """Tokens [lo, hi) of a per-token input; a constant decay's g [H] (or None) as it is."""
    return x if x is None or x.dim() == 1 else x[:, lo:hi]


def _offsets_tensor(offsets, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(offsets, dtype=torch.int64, device=like.device)


class ContextParallel:
    """An op over time shards of its sequences, one shard per rank of a process group (see the
    module's docstring). `method` forces the planner's choice (planner.parallel)."""

    def __init__(self, op: Op, group=None, method: str | None = None):
        if not isinstance(op, Op):
            raise ValueError(f"op: expected an attngen op (attngen.load(spec)), got {type(op).__name__}")
        self.op = op
        self.group = group
        self.parallel = planner.parallel(op.spec, method)
        self._base = None

    @property
    def spec(self):
        return self.op.spec

    def __repr__(self) -> str:
        return f"attngen.distributed.ContextParallel({self.op.spec.name}, method {self.parallel.method})"

    def base(self) -> Op:
        """The op the shards run: the spec itself, or without its sum normalizer (the ranks then
        exchange and correct the sums, and divide last)."""
        if self._base is None:
            if self.parallel.unnormalized:
                spec = self.op.spec
                self._base = load(dict(spec.to_dict(), name=f"{spec.name[:51]}_unnormalized", normalize="none"))
            else:
                self._base = self.op
        return self._base

    def __call__(self, q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                 cu_seqlens=None, *, shard_lengths=None, form: str | None = None, chunk_size: int | None = None):
        """The op's call on this rank's shard. shard_lengths: every rank's T_r in rank order (the
        same on every rank); None: gathered from the ranks when needed (packed calls, softmax)."""
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized; call "
                             "torch.distributed.init_process_group first")
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise ValueError(f"q: expected this rank's shard [B, T_r, H, K], got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        shard = self._shard(q, cu_seqlens, shard_lengths)
        kw = dict(form=form, chunk_size=chunk_size)
        if not self.op.spec.is_linear:
            if beta is not None or initial_state is not None or output_final_state:
                raise ValueError("beta, initial_state, output_final_state: softmax attention takes none of "
                                 "these (they are for attention: linear)")
            return self._keys(shard, q, k, v, g, scale, kw)
        if self.parallel.method == "sum":
            return self._sum(shard, q, k, v, scale, initial_state, output_final_state, kw)
        return self._carry(shard, q, k, v, g, beta, scale, initial_state, output_final_state, kw)

    # ------------------------------------------------------------------ the shard layout

    def _shard(self, q, cu_seqlens, shard_lengths) -> Shard:
        rank, ranks = dist.get_rank(self.group), dist.get_world_size(self.group)
        T = q.shape[1]
        if T == 0:
            raise ValueError(f"q: this rank's shard (rank {rank}) is empty, got {tuple(q.shape)}; every rank "
                             "holds at least one token")
        if shard_lengths is not None:
            lengths = tuple(shard_lengths)
            if (len(lengths) != ranks or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                             for n in lengths)):
                raise ValueError(f"shard_lengths: expected {ranks} positive integers (one per rank), got "
                                 f"{shard_lengths!r}")
            if lengths[rank] != T:
                raise ValueError(f"shard_lengths: entry {rank} is {lengths[rank]}, but this rank's q holds "
                                 f"T_r = {T} tokens")
        elif cu_seqlens is not None or not self.op.spec.is_linear:
            # one small collective (and a host read) per call; shard_lengths spares it
            mine = torch.tensor([T], dtype=torch.int64, device=q.device)
            lengths = tuple(gather(mine, group=self.group)[0].flatten().tolist())
        else:
            lengths = None
        bounds = None if lengths is None else (0, *itertools.accumulate(lengths))
        cu = None
        if cu_seqlens is not None:
            if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
                raise ValueError("cu_seqlens: expected a 1-D integer tensor [N + 1], the offsets of the whole "
                                 "call (the same on every rank)")
            if q.shape[0] != 1:
                raise ValueError(f"cu_seqlens: packed sequences need batch size 1, got q {tuple(q.shape)}")
            cu = tuple(cu_seqlens.tolist())
            if len(cu) < 2 or cu[0] != 0 or cu[-1] != bounds[-1] or any(b <= a for a, b in zip(cu, cu[1:])):
                raise ValueError(f"cu_seqlens: expected strictly increasing offsets from 0 to the shards' total "
                                 f"{bounds[-1]} (shard lengths {list(lengths)}), got {list(cu)}")
        return Shard(rank, ranks, bounds, cu)

    def _setup(self, shard, q, k, v, g, beta, scale, s0):
        """What the linear methods start from: the context of the shard's PyTorch stages (its
        checked call, the state's dtype), the values the shards run on ([v, 1] with normalize
        sum), the offsets of the pieces of sequences in the shard, and the initial states of the
        sequences that start in it, checked."""
        call = check_linear(self.op.spec, q, k, v, g, beta, scale)
        if call.qk_heads != call.heads:
            raise ValueError(f"v: {call.heads} value heads on {call.qk_heads} query / key heads (grouped value "
                             "heads) are not supported by context parallelism; allowed: v with the heads of q")
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        u = torch.cat([v, torch.ones_like(v[..., :1])], -1) if self.parallel.unnormalized else v
        packed, cin = shard.cu is not None, shard.crosses_in(shard.rank)
        offsets = shard.offsets(shard.rank) if packed else (0, call.q_len)
        starting = len(offsets) - 1 - cin if packed else (0 if cin else call.batch)
        s0 = self._initial_rows(shard, s0, starting, (call.heads, call.feature_dim, u.shape[-1]))
        return self.op.context(call, 1, dtype, q.device), u, offsets, s0

    def _initial_rows(self, shard: Shard, s0, starting: int, shape: tuple[int, ...]):
        """The user's initial states of the sequences that start in this shard, checked."""
        if s0 is None or (starting == 0 and isinstance(s0, torch.Tensor) and s0.shape[0] == 0):
            return None
        want = (starting, *shape)
        if starting == 0:
            raise ValueError(f"initial_state: no sequence starts in rank {shard.rank}'s shard, so it takes None; "
                             f"got {tuple(s0.shape)}")
        if not isinstance(s0, torch.Tensor) or tuple(s0.shape) != want:
            got = tuple(s0.shape) if isinstance(s0, torch.Tensor) else type(s0).__name__
            raise ValueError(f"initial_state: expected [N_r, H, F, V] = {list(want)}, the states of the {starting} "
                             f"sequence(s) that start in rank {shard.rank}'s shard, got {got}")
        return s0

    # ------------------------------------------------------------------ causal linear: affine, decay

    def _carry(self, shard, q, k, v, g, beta, scale, s0, output_final_state, kw):
        """Causal linear attention: the state a shard passes on is an affine map of the one it
        receives, S_out = M S_in + S_loc. Each rank runs its shard from a zero state, the ranks
        all-gather (M, S_loc) and each composes those before it into the state entering its
        shard, C, which it adds to its outputs (o_t += C^T r_t) and final state."""
        method, r, packed = self.parallel.method, shard.rank, shard.cu is not None
        B, T, H, K = q.shape
        ctx, u, offsets, s0 = self._setup(shard, q, k, v, g, beta, scale, s0)
        F, Vs, sdt = ctx.call.feature_dim, u.shape[-1], ctx.dtype
        pieces, cin, cout = len(offsets) - 1, shard.crosses_in(r), shard.crosses_out(r)
        base = self.base()

        def run(lo, hi, values, state, cu):
            return base(q[:, lo:hi], k[:, lo:hi], values, _cut(g, lo, hi), _cut(beta, lo, hi), scale, state, True,
                        cu, **kw)

        # the piece that continues a sequence from the rank before (the whole shard, unpacked)
        split = offsets[1] if cin else 0
        outs, finals = [], []
        if cin:
            if method == "affine":
                values = torch.cat([u[:, :split], u.new_zeros(B, split, H, F)], -1)
                eye = torch.eye(F, dtype=sdt, device=q.device).expand(B, H, F, F)
                o_aug, s_aug = run(0, split, values, torch.cat([eye.new_zeros(B, H, F, Vs), eye], -1), None)
                o_loc, weights = o_aug[..., :Vs], o_aug[..., Vs:]
                s_loc, m = s_aug[..., :Vs], s_aug[..., Vs:]
            else:
                o_loc, s_loc = run(0, split, u[:, :split], None, None)
                # [B, L, H, Fg] the decay since the shard's start (differences of cumulative log decays)
                G = forms.log_decay(ctx, g)[:, :split].to(torch.float64).cumsum(1)
                weights = forms.query_features(ctx, q[:, :split]) * G.exp().to(sdt)
                m = G[:, -1].exp().to(sdt)[..., None].expand(B, H, F, 1)
            summary = torch.cat([s_loc.to(sdt), m], -1)
        if split < T:
            local = _offsets_tensor([o - split for o in offsets[cin:]], q) if packed else None
            o_rest, s_rest = run(split, T, u[:, split:], s0, local)
            if not shard.carries(r):
                last = s_rest[-1:] if packed else s_rest
                summary = torch.cat([last.to(sdt), last.new_zeros(*last.shape[:3], F if method == "affine" else 1)
                                     .to(sdt)], -1)
        parts, = gather(summary, group=self.group, anchors=(q, k, v, g, beta, s0))
        if cin:
            carried = None
            for j in range(r):
                s_j, m_j = parts[j][..., :Vs], parts[j][..., Vs:]
                # a rank whose last piece starts inside it passes on its own state: no product with
                # its M = 0, which would carry a NaN of another sequence into this one
                carried = s_j if carried is None or not shard.carries(j) else self._apply(m_j, carried) + s_j
            outs.append(o_loc.to(sdt) + torch.einsum("blhf,bhfv->blhv", weights.to(sdt), carried))
            if pieces > 1 or not cout:
                finals.append(s_loc.to(sdt) + self._apply(m, carried))
        if split < T:
            outs.append(o_rest.to(sdt))
            if packed:
                finals.append(s_rest[:-1] if cout else s_rest)
            elif not cout:
                finals.append(s_rest)
        o = torch.cat(outs, 1)
        if self.parallel.unnormalized:
            o = forms.normalize_output(ctx, o)
        final = torch.cat([f.to(sdt) for f in finals]) if finals else q.new_zeros(0, H, F, Vs, dtype=sdt)
        return after((o.to(q.dtype), final if output_final_state else None), (parts,))

    def _apply(self, m, state):
        """M S: a matrix [.., F, F] (affine) or a diagonal [.., F, 1] (decay)."""
        return m @ state if self.parallel.method == "affine" else m * state

    # ------------------------------------------------------------------ bidirectional linear

    def _sum(self, shard, q, k, v, scale, s0, output_final_state, kw):
        """Bidirectional linear attention: a sequence's state is the sum of its pieces' states
        (the initial state in the piece that starts it). Each rank all-gathers the states of its
        pieces that continue on other ranks (its first and last, packed), and adds those of the
        other ranks' pieces of the same sequence to the outputs (o_t += C^T q_t) and final states."""
        r, packed = shard.rank, shard.cu is not None
        B, T, H, K = q.shape
        ctx, u, offsets, s0 = self._setup(shard, q, k, v, None, None, scale, s0)
        F, Vs, sdt = ctx.call.feature_dim, u.shape[-1], ctx.dtype
        pieces, cin, cout = len(offsets) - 1, shard.crosses_in(r), shard.crosses_out(r)
        if s0 is not None and cin:
            s0 = torch.cat([s0.new_zeros(1, H, F, Vs), s0])
        o, states = self.base()(q, k, u, None, None, scale, s0, True, _offsets_tensor(offsets, q) if packed else None,
                                **kw)
        o, states = o.to(sdt), states.to(sdt)

        def slots(j):
            """(piece of rank j, its sequence) whose states rank j puts in each slot, None where a
            slot holds no piece that continues elsewhere."""
            if not packed:
                return [(0, None)] if shard.ranks > 1 else [None]
            n, first = shard.pieces(j), shard.first_sequence(j)
            head = (0, first) if shard.crosses_in(j) or (n == 1 and shard.crosses_out(j)) else None
            tail = (n - 1, first + n - 1) if n > 1 and shard.crosses_out(j) else None
            return [head, tail]

        mine = slots(r)
        piece_state = (lambda i: states[i:i + 1]) if packed else (lambda i: states)
        sent = torch.stack([piece_state(s[0]) if s else states.new_zeros(1, H, F, Vs) for s in mine])
        parts, = gather(sent, group=self.group, anchors=(q, k, v, s0))
        corrected = {}   # piece -> its outputs and state with the other ranks' pieces of its sequence added
        for s in mine:
            if s is None:
                continue
            piece, seq = s
            carried = torch.stack([parts[j, i] for j in range(shard.ranks) if j != r
                                   for i, t in enumerate(slots(j)) if t is not None and t[1] == seq]).sum(0)
            lo, hi = offsets[piece], offsets[piece + 1]
            q_hat = forms.query_features(ctx, q[:, lo:hi])
            corrected[piece] = (o[:, lo:hi] + torch.einsum("blhf,bhfv->blhv", q_hat, carried),
                                piece_state(piece) + carried)
        o = torch.cat([corrected[i][0] if i in corrected else o[:, lo:hi]
                       for i, (lo, hi) in enumerate(zip(offsets, offsets[1:]))], 1)
        if self.parallel.unnormalized:
            o = forms.normalize_output(ctx, o)
        # the sequences that end here: every piece but a last one that continues
        finals = [corrected[i][1] if i in corrected else piece_state(i) for i in range(pieces - cout)]
        final = torch.cat(finals) if finals else states.new_zeros(0, H, F, Vs)
        return after((o.to(q.dtype), final if output_final_state else None), (parts,))

    # ------------------------------------------------------------------ softmax

    def _keys(self, shard, q, k, v, g, scale, kw):
        """Softmax attention: the ranks all-gather their keys and values (and g); each runs its
        queries against the keys they may see, which end at its shard's end (causal, window) or
        at the sequence's end (bidirectional). Pieces of sequences that lie whole in the shard run
        as one packed call on the shard's own keys."""
        r, T = shard.rank, q.shape[1]
        longest = max(b - a for a, b in zip(shard.bounds, shard.bounds[1:]))
        # every rank's [B, T_j, *] shards of k, v (and g), padded to the longest
        parts = gather(*(torch.cat([x, x.new_zeros(x.shape[0], longest - T, *x.shape[2:])], 1)
                         for x in (k, v, g) if x is not None), group=self.group, anchors=(q,))
        start = shard.bounds[r]
        packed = shard.cu is not None
        offsets = shard.offsets(r) if packed else (0, T)
        segments = []   # (lo, hi, keys [klo, khi) or None for the piece's own tokens, packed offsets)
        local = []
        for i in range(len(offsets) - 1):
            lo, hi = offsets[i], offsets[i + 1]
            n = shard.first_sequence(r) + i if packed else 0
            s_lo, s_hi = (shard.cu[n], shard.cu[n + 1]) if packed else (0, shard.bounds[-1])
            klo, khi = self._visible(start + lo, start + hi, s_lo, s_hi)
            if (klo, khi) == (start + lo, start + hi):
                local.append((lo, hi))
                continue
            if local:
                segments.append(self._local(local, packed))
                local = []
            segments.append((lo, hi, (klo, khi), None))
        if local:
            segments.append(self._local(local, packed))
        outs = []
        for lo, hi, keys, offs in segments:
            if keys is None:
                cu = _offsets_tensor(offs, q) if offs is not None else None
                outs.append(self.op(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], _cut(g, lo, hi), None, scale, cu_seqlens=cu,
                                    **kw))
                continue
            seen = [self._span(x, shard, *keys) for x in parts]
            outs.append(self.op(q[:, lo:hi], seen[0], seen[1], seen[2] if g is not None else None, None, scale,
                                **kw))
        return after((torch.cat(outs, 1),), parts)[0]

    @staticmethod
    def _local(local, packed):
        lo, hi = local[0][0], local[-1][1]
        offs = (0, *(b - lo for _, b in local)) if packed else None
        return (lo, hi, None, offs)

    def _visible(self, lo: int, hi: int, seq_lo: int, seq_hi: int) -> tuple[int, int]:
        """The keys [klo, khi) that queries [lo, hi) of a sequence [seq_lo, seq_hi) may see."""
        spec = self.op.spec
        if spec.mask == "bidirectional":
            return seq_lo, seq_hi
        if spec.mask == "sliding_window":
            return max(seq_lo, lo - spec.window + 1), hi
        return seq_lo, hi

    @staticmethod
    def _span(parts, shard, lo: int, hi: int):
        """Tokens [lo, hi) of the whole time axis from the gathered shards [R, B, T_max, *]."""
        pieces = []
        for j in range(shard.ranks):
            a, b = shard.bounds[j], shard.bounds[j + 1]
            if a < hi and b > lo:
                pieces.append(parts[j, :, max(lo, a) - a:min(hi, b) - a])
        return torch.cat(pieces, 1) if len(pieces) > 1 else pieces[0]
