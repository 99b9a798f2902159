"""The planner: Spec -> Plan. A plan lists the legal forms of a spec, each a DAG of named
stages (networkx) with typed inputs and outputs, and the rule that picks a form per call.

Forms are data. `execute` runs a form with the PyTorch stage functions of forms.py, so the
lowering is testable apart from any code generation.
"""
from __future__ import annotations

import dataclasses

import networkx as nx
import torch

from . import forms
from .inputs import Call
from .spec import L2_EPS, LOG_DECAY_FLOOR, NORM_EPS, Spec

# The rule that picks a form (linear attention, per call). Sequences up to RECURRENT_MAX_LEN
# tokens run the token loop; up to PARALLEL_MAX_LEN the quadratic form; longer, the chunked
# form with DEFAULT_CHUNK tokens per chunk.
RECURRENT_MAX_LEN = 16
PARALLEL_MAX_LEN = 64
DEFAULT_CHUNK = 64
FORM_NAMES = ("recurrent", "parallel", "chunked")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step of a form: forms.<fn>(ctx, **{arg: env[name]}) -> outputs, in order."""

    fn: str
    inputs: tuple[tuple[str, str], ...]   # (argument, value name)
    outputs: tuple[str, ...]
    doc: str

    def signature(self) -> str:
        ins = ", ".join(name if arg == name else f"{arg}={name}" for arg, name in self.inputs)
        return f"{self.fn}({ins}) -> {', '.join(self.outputs)}"


@dataclasses.dataclass(frozen=True)
class Form:
    name: str
    stages: tuple[Stage, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    doc: str

    def graph(self) -> nx.DiGraph:
        """Stages as nodes ("<position>.<fn>": a stage function may be applied twice), an edge
        per value passed from one stage to another."""
        dag = nx.DiGraph()
        producer: dict[str, str] = {name: "input" for name in self.inputs}
        dag.add_node("input")
        for i, stage in enumerate(self.stages, 1):
            node = f"{i}.{stage.fn}"
            dag.add_node(node, stage=stage)
            for _, name in stage.inputs:
                dag.add_edge(producer[name], node, value=name)
            for name in stage.outputs:
                producer[name] = node
        dag.add_node("output")
        for name in self.outputs:
            dag.add_edge(producer[name], "output", value=name)
        return dag


@dataclasses.dataclass(frozen=True)
class Plan:
    spec: Spec
    forms: tuple[Form, ...]

    def form(self, name: str) -> Form:
        for f in self.forms:
            if f.name == name:
                return f
        legal = ", ".join(f.name for f in self.forms)
        raise ValueError(f"form: {name!r} is not a legal form of spec {self.spec.name!r}; legal: {legal}")


@dataclasses.dataclass(frozen=True)
class Choice:
    form: str
    chunk: int
    reason: str


def validate_form(form: Form) -> None:
    """Every stage reads values that exist, nothing is produced twice, the graph is acyclic."""
    known = set(form.inputs)
    for stage in form.stages:
        if not hasattr(forms, stage.fn):
            raise ValueError(f"form {form.name}: stage {stage.fn!r} has no implementation in forms.py")
        for _, name in stage.inputs:
            if name not in known:
                raise ValueError(f"form {form.name}: stage {stage.fn} reads {name!r} before it is produced")
        for name in stage.outputs:
            if name in known:
                raise ValueError(f"form {form.name}: {name!r} is produced twice")
            known.add(name)
    missing = set(form.outputs) - known
    if missing:
        raise ValueError(f"form {form.name}: outputs {sorted(missing)} are never produced")
    if not nx.is_directed_acyclic_graph(form.graph()):
        raise ValueError(f"form {form.name}: the stage graph has a cycle")


def _s(fn: str, ins: dict[str, str] | tuple[str, ...], outs: tuple[str, ...] | str, doc: str) -> Stage:
    pairs = tuple(ins.items()) if isinstance(ins, dict) else tuple((n, n) for n in ins)
    return Stage(fn, pairs, (outs,) if isinstance(outs, str) else outs, doc)


def _linear_forms(spec: Spec) -> tuple[Form, ...]:
    norm = spec.normalize == "sum"
    head = [
        _s("feature_map", ("q", "k"), ("q_hat", "k_hat"), "phi, l2 norm and scale on q"),
        _s("log_decay", ("g",), "log_g", f"per-token log decay ({spec.decay})"),
    ]
    v = "v"
    if norm:
        head.append(_s("normalizer_column", ("v",), "v_aug", "append the ones column of the sum normalizer"))
        v = "v_aug"
    head.append(_s("to_sequences", {"q": "q_hat", "k": "k_hat", "v": v, "g": "log_g", "beta": "beta",
                                    "cu_seqlens": "cu_seqlens"},
                   ("qs", "ks", "vs", "gs", "bs", "valid"), "one padded row per sequence, [N, H, L, *]"))
    out = "o_sum" if norm else "o"
    tail = [_s("from_sequences", {"out": "os", "valid": "valid"}, out, "back to [B, T, H, *]")]
    if norm:
        tail.append(_s("normalize_output", {"o": "o_sum"}, "o", "divide by z.q + eps"))
    inputs = ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens")
    outputs = ("o", "final_state")

    if spec.mask == "bidirectional":
        body = [_s("global_state", {"ks": "ks", "vs": "vs", "s0": "initial_state"}, "final_state",
                   "S = S0 + K^T V"),
                _s("readout", {"qs": "qs", "S": "final_state"}, "os", "o_t = S^T q_t")]
        return (Form("parallel", tuple(head + body + tail), inputs, outputs,
                     "every token reads the whole sequence's state"),)

    recurrent = [_s("token_scan", {"qs": "qs", "ks": "ks", "vs": "vs", "gs": "gs", "bs": "bs",
                                   "s0": "initial_state"}, ("os", "final_state"), "one step per token")]
    chunk = [_s("chunk_decay", ("gs",), "G", "cumulative log decay inside each chunk"),
             _s("intra_chunk", ("qs", "ks", "G"), "P", "decayed causal q.k scores inside each chunk")]
    scan_in = {"qs": "qs", "ks": "ks", "values": "vs", "G": "G", "P": "P", "s0": "initial_state"}
    if spec.update == "delta":
        chunk.append(_s("ut_transform", ("ks", "vs", "bs", "G"), ("W", "U"),
                        "WY representation: solve (I + A) [W U] = diag(beta) [K*Gamma V]"))
        scan_in.update(values="U", W="W")
    chunk.append(_s("state_scan", scan_in, ("os", "final_state"),
                    "per chunk: U - W S, (Q*Gamma) S + P U, state passed on"))
    return (
        Form("recurrent", tuple(head + recurrent + tail), inputs, outputs, "the token loop"),
        Form("parallel", tuple(head + chunk + tail), inputs, outputs,
             "the quadratic form: one chunk spanning the sequence"),
        Form("chunked", tuple(head + chunk + tail), inputs, outputs,
             "intra-chunk parallel, inter-chunk state passing"),
    )


def _softmax_forms(spec: Spec) -> tuple[Form, ...]:
    stages = (
        _s("to_sequences", {"q": "q", "k": "k", "v": "v", "g": "g", "beta": "beta", "cu_seqlens": "cu_seqlens"},
           ("qs", "ks_kv", "vs_kv", "gs", "bs", "valid"),
           "one padded row per sequence, [N, H, L, *] ([N, H_kv, L, *] k, v)"),
        _s("share_kv_heads", {"ks": "ks_kv", "vs": "vs_kv"}, ("ks", "vs"),
           "grouped-query attention: each query head's keys and values"),
        _s("softmax_attend", ("qs", "ks", "vs", "gs", "valid"), ("os", "lses"),
           f"masked softmax ({spec.mask}{', decay bias' if spec.decay == 'scalar' else ''}) per query block, "
           "and each query's log-sum-exp"),
        _s("from_sequences", {"out": "os", "valid": "valid"}, "o", "back to [B, Tq, H, V]"),
        _s("from_sequences", {"out": "lses", "valid": "valid"}, "lse", "back to [B, Tq, H]"),
    )
    return (Form("parallel", stages, ("q", "k", "v", "g", "beta", "cu_seqlens"), ("o", "lse"),
                 "flash-style: scores, mask, softmax, values"),)


def plan(spec: Spec) -> Plan:
    built = _linear_forms(spec) if spec.is_linear else _softmax_forms(spec)
    for form in built:
        validate_form(form)
    return Plan(spec, built)


def choose(plan_: Plan, call: Call, form: str | None = None, chunk: int | None = None) -> Choice:
    """The form and chunk size for one call: the user's if given, else by sequence length."""
    legal = [f.name for f in plan_.forms]
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                              or chunk < 1 or chunk & (chunk - 1) or chunk > 256):
        raise ValueError(f"chunk_size: expected a power of two from 1 to 256, got {chunk!r}")
    if form is not None:
        plan_.form(form)
        reason = "asked for"
    elif len(legal) == 1:
        form, reason = legal[0], "the only form"
    elif call.max_len <= RECURRENT_MAX_LEN:
        form, reason = "recurrent", f"longest sequence {call.max_len} <= {RECURRENT_MAX_LEN} tokens"
    elif call.max_len <= PARALLEL_MAX_LEN:
        form, reason = "parallel", f"longest sequence {call.max_len} <= {PARALLEL_MAX_LEN} tokens"
    else:
        form, reason = "chunked", f"longest sequence {call.max_len} > {PARALLEL_MAX_LEN} tokens"
    if form == "chunked":
        size = chunk or DEFAULT_CHUNK
    elif form == "parallel" and plan_.spec.is_linear and plan_.spec.mask != "bidirectional":
        size = call.max_len  # one chunk spans the sequence
    else:
        size = 1
    return Choice(form, size, reason)


# The PyTorch forms run a packed call (cu_seqlens) in groups of sequences, each group padded to
# its longest: sequences whose lengths round up to the same power of two of PACK_UNIT tokens (of
# chunks, in the chunked form) form a group. Padding then at most doubles a group's tokens (and
# quadruples the quadratic forms' work) and there are O(log T) groups, so the cost follows the
# total number of tokens, not the number of sequences times the longest.
PACK_UNIT = 16


def packed_groups(lengths: list[int], choice: Choice) -> list[list[int]]:
    """The sequences (indices into lengths) of each group a packed call runs as, shortest first."""
    unit = choice.chunk if choice.form == "chunked" else PACK_UNIT
    groups: dict[int, list[int]] = {}
    for n, length in enumerate(lengths):
        groups.setdefault((-(-length // unit) - 1).bit_length(), []).append(n)
    return [groups[key] for key in sorted(groups)]


# Context parallelism (attngen.distributed): ranks hold consecutive time shards of the same
# sequences and exchange, with one all-gather (its gradient one reduce-scatter in the backward),
# what each needs from the others. The method follows from the spec:
PARALLEL_METHODS = {
    "affine": "a shard maps the state entering it affinely, S_out = M S_in + S_loc: one run of the op on "
              "values [v | 0_F] from the state [0 | I] gives [S_loc | M] as its final state and, in its "
              "outputs' last F columns, r_t = M_t^T q_t, so o_t = o_loc_t + S_in^T r_t (no second run); "
              "all-gather the (M, S_loc) summaries, compose those of the ranks before",
    "decay": "additive rule: M is the decay product (diagonal; I without decay), known from g alone: one run "
             "from a zero state gives o_loc and S_loc, and o_t = o_loc_t + S_in^T (Gamma_t q_t) with Gamma_t "
             "the decay since the shard's start; all-gather the (diag M, S_loc) summaries, compose those of "
             "the ranks before",
    "sum": "bidirectional: a sequence's state is the sum of its pieces' K^T V: all-gather the states of the "
           "pieces that continue on other ranks, add those of the same sequence, o_t += S_others^T q_t",
    "keys": "all-gather the keys and values (and g): each rank attends its queries to the keys up to its "
            "shard's end (the op aligns causal and window masks to the end when Tq < Tk). Not a ring: one "
            "exchange each way and the op unchanged (a ring would merge partial results by their "
            "log-sum-exp; not built); the cost is memory, every rank holding the keys it may see",
}


@dataclasses.dataclass(frozen=True)
class Parallel:
    """How a spec runs context-parallel: its method (PARALLEL_METHODS) and why."""

    method: str
    legal: tuple[str, ...]
    reason: str
    unnormalized: bool      # normalize sum: the ranks exchange and correct the un-normalized sums


def parallel(spec: Spec, method: str | None = None) -> Parallel:
    """The context-parallel method of a spec: the user's if given (and legal), else the cheapest."""
    if not spec.is_linear:
        legal, reason = ("keys",), "softmax attention"
    elif spec.mask == "bidirectional":
        legal, reason = ("sum",), "bidirectional linear attention"
    elif spec.update == "additive":
        legal, reason = ("decay", "affine"), "additive rule: M from g alone, no F x F exchange"
    else:
        legal, reason = ("affine",), "delta rule: M depends on the keys"
    if method is not None:
        if method not in legal:
            raise ValueError(f"method: {method!r} is not a context-parallel method of spec {spec.name!r}; "
                             f"legal: {', '.join(legal)}")
        reason = "asked for"
    return Parallel(method or legal[0], legal, reason, spec.is_linear and spec.normalize == "sum")


def exchange_elements(spec: Spec, method: str, batch: int, shard_len: int, heads: int, kv_heads: int,
                      head_dim: int, value_dim: int, packed: bool) -> tuple[tuple[str, int, str], ...]:
    """What one rank puts into the forward all-gather: (what, elements, dtype) per buffer; dtype
    'state' is the state's (float32, float64 for float64 inputs), 'input' that of q."""
    F = spec.feature_dim(head_dim)
    Vs = value_dim + 1 if spec.is_linear and spec.normalize == "sum" else value_dim
    rows = 1 if packed else batch
    if method == "affine":
        return (("[M | S_loc]", rows * heads * F * (F + Vs), "state"),)
    if method == "decay":
        return (("[diag M | S_loc]", rows * heads * F * (1 + Vs), "state"),)
    if method == "sum":
        # a packed shard may hold the pieces of two sequences that continue elsewhere
        return (("pieces' states", (2 if packed else 1) * rows * heads * F * Vs, "state"),)
    out = [("k", batch * shard_len * kv_heads * head_dim, "input"), ("v", batch * shard_len * kv_heads * value_dim,
                                                                          "input")]
    if spec.decay == "scalar":
        out.append(("g", batch * shard_len * heads, "g"))
    return tuple(out)


# What each rank computes beyond its shard's own call, per method.
PARALLEL_WORK = {
    "affine": "rank 0 runs the op on its shard; the others on V + F value columns (the identity's F columns "
              "carry M and r), plus one [T_r, F] x [F, V] product per head",
    "decay": "every rank runs the op once on its shard; the others add one [T_r, F] x [F, V] product per head",
    "sum": "every rank runs the op once on its shard; pieces that continue elsewhere add one [T_r, F] x [F, V] "
           "product per head",
    "keys": "rank r attends its T_r queries to the keys it may see, up to its shard's end: with equal shards of "
            "causal attention the last rank does (2R - 1)/R^2 of the work; shards ending at T sqrt(r/R) "
            "balance it",
}


def explain_parallel(spec: Spec, ranks: int, batch: int, length: int, heads: int, head_dim: int,
                     value_dim: int, input_bytes: int = 2) -> str:
    """The context-parallel plan over `ranks` equal shards of `length` tokens, and its bytes per
    rank (states in float32, keys and values of `input_bytes` each)."""
    par = parallel(spec)
    shard = -(-length // ranks)
    bufs = exchange_elements(spec, par.method, batch, shard, heads, heads, head_dim, value_dim, packed=False)
    size = {"state": 4, "input": input_bytes, "g": 4}
    each = sum(n * size[d] for _, n, d in bufs)
    what = " and ".join(f"{name} ({n} values of {size[d]} bytes)" for name, n, d in bufs)
    lines = [f"context parallel over {ranks} ranks (attngen.distributed), B={batch}, shards of {shard} tokens: "
             f"method {par.method} ({par.reason}; legal: {', '.join(par.legal)})",
             f"  {PARALLEL_METHODS[par.method]}",
             f"  {PARALLEL_WORK[par.method]}"]
    if par.unnormalized:
        lines.append("  normalize sum: the shards run the spec without its normalizer on [v, 1]; the division "
                     "comes after the correction")
    lines += [f"  exchange: all-gather forward of {what} from each rank; backward its gradient, a "
              "reduce-scatter of the same size",
              f"  per rank and step: contributes {_bytes(each)} and receives {_bytes(each * (ranks - 1))} "
              "forward, the same backward"]
    return "\n".join(lines)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Every structural choice the kernel templates need, decided here, once."""

    name: str
    spec_hash: str
    spec_dict: str                  # the spec's canonical dict as a Python literal (Spec.to_dict)
    semantics: str
    attention: str                  # linear | softmax
    forms: tuple[str, ...]
    feature: str                    # identity | elementwise | favor_plus
    phi: str                        # Triton source of phi(x) (elementwise maps)
    phi_grad: str                   # Triton source of phi'(x)
    qk_norm: bool
    update: str                     # additive | delta
    decay: str                      # none | constant | scalar | vector
    normalize: bool
    mask: str                       # causal | bidirectional | sliding_window
    window: int
    l2_eps: float                   # qk_norm l2: x / sqrt(|x|^2 + l2_eps)
    norm_eps: float                 # normalize sum: o / (z.q + norm_eps)
    log_decay_floor: float          # log decays are raised to it where the kernels load them
    decay_span: float               # vector decay: a 16-token block's scores in one dot while its decay spans <= this


# Vector decay: a 16-token block's pair scores sum_f x_tf y_sf exp(G_tf - G_sf) (s <= t) are one dot of
# X ⊙ exp(G) and Y ⊙ exp(-G), G the log decay cumulated from the block's start, when the block's
# decay G_B spans at most this in every feature: the factors stay within e^±40 (fp32 and bf16 reach
# e^88; a term x_t y_s of 1e-21 or more keeps normal operands). The backward's pair sums inside a block
# (dq̂, dk̂, P^T, the delta rule's K K^T) take the same dots and the same test, per chunk. Past it, the
# kernels take the pairs by offsets t - s, each factor the exp of a sum of log decays (<= 1), exact for
# any decay.
DECAY_SPAN = 40.0


def kernel_spec(spec: Spec) -> KernelSpec:
    from . import algebra  # sympy only when generating code

    if spec.is_linear and spec.feature_map != "favor_plus":
        expr = algebra.feature_expr(spec.feature_map, spec.feature_expr)
        phi, phi_grad = algebra.triton_source(expr), algebra.triton_source(algebra.derivative(expr))
        feature = "identity" if spec.feature_map == "identity" else "elementwise"
    else:
        phi = phi_grad = "x"
        feature = "favor_plus" if spec.is_linear else "identity"
    return KernelSpec(
        name=spec.name, spec_hash=spec.hash, spec_dict=repr(spec.to_dict()), semantics=spec.describe(),
        attention=spec.attention,
        forms=tuple(f.name for f in plan(spec).forms), feature=feature, phi=phi, phi_grad=phi_grad,
        qk_norm=spec.qk_norm == "l2", update=spec.update, decay=spec.decay,
        normalize=spec.normalize == "sum", mask=spec.mask, window=spec.window or 0,
        l2_eps=L2_EPS, norm_eps=NORM_EPS, log_decay_floor=LOG_DECAY_FLOOR, decay_span=DECAY_SPAN)


def execute(form: Form, ctx: forms.Ctx, env: dict[str, torch.Tensor | None]) -> dict:
    """Run a form's stages with the PyTorch stage functions, in the order listed: validate_form
    checked it is a topological order of the stage graph (no graph is built per call, so
    torch.compile traces straight through)."""
    env = dict(env)
    for stage in form.stages:
        result = getattr(forms, stage.fn)(ctx, **{arg: env[name] for arg, name in stage.inputs})
        result = result if isinstance(result, tuple) else (result,)
        env.update(zip(stage.outputs, result))
    return {name: env[name] for name in form.outputs}


def explain(plan_: Plan) -> str:
    """The plan as text: semantics, then each form's stages."""
    lines = [f"{plan_.spec.name}: {plan_.spec.describe()}", f"legal forms: {', '.join(f.name for f in plan_.forms)}"]
    for form in plan_.forms:
        lines.append(f"\nform {form.name}: {form.doc}")
        for i, stage in enumerate(form.stages, 1):
            lines.append(f"  {i:2d}. {stage.signature():<70s} # {stage.doc}")
    lines.append("\n" + MEMORY[_memory_key(plan_.spec)])
    return "\n".join(lines)


# What a training step keeps beyond the inputs and outputs, per form of the kernels.
MEMORY = {
    "softmax": "training memory (kernels): the forward saves o and the log-sum-exp (O(T) per head); "
               "the backward recomputes the scores tile by tile",
    "bidirectional": "training memory (kernels): the forward saves o; the backward recomputes through the "
                     "PyTorch form (autograd keeps its O(T (F + V)) intermediates)",
    "causal": "training memory (kernels): the forward saves o and the final state; the chunked forward "
              "keeps the chunk-start states (T/C x F x V floats per head, float32) and the decayed keys "
              "(T x F values, bf16 for bf16 inputs, else float32; with the delta rule also W and the written "
              "values, T x (F + V), and the UT transform's (I + A)^-1, T x C float32) only during the call; the "
              "recurrent backward keeps per-token partials, O(T (K + V)) per head times the value blocks; the "
              "chunked backward recomputes the chunk-start states at chunks of at most 32 tokens (T/32 x F x "
              "V floats per head) and keeps per-value-block dq/dk partials (additive rules) or, with the delta "
              "rule, the state gradient per chunk (as many floats as the states) and per-token pieces (dU, the "
              "decayed queries, a dk part: T x (2F + V)), transient inside the backward",
}


def _memory_key(spec: Spec) -> str:
    if not spec.is_linear:
        return "softmax"
    return "bidirectional" if spec.mask == "bidirectional" else "causal"
