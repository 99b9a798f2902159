"""The planner: Spec -> Plan. A plan lists the legal forms of a spec, each a DAG of named
stages (networkx) with typed inputs and outputs, and the rule that picks a form per call.

Forms are data. `execute` runs a form with the PyTorch stage functions of forms.py, so the
lowering is testable apart from any code generation.
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import networkx as nx
import torch

from . import forms, hooks
from .inputs import Call
from .spec import KERNEL_CHUNKS, L2_EPS, NORM_EPS, Spec

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
    asked_chunk: int | None = None     # the caller's chunk_size, which holds the kernels to it too


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
        _s("feature_map", ("q", "k"), ("q_feat", "k_feat"), "phi, l2 norm and scale on q"),
        _s("share_qk_heads", {"q_hat": "q_feat", "k_hat": "k_feat"}, ("q_hat", "k_hat"),
           "grouped value heads: each value head's queries and keys"),
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
    if spec.rule.ut_transform:
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
    """The form and chunk size for one call: the user's if given, else by sequence length. A chunk
    size asks for the chunked form (an error where the call asks for another form or the spec has none)."""
    legal = [f.name for f in plan_.forms]
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                              or chunk < 1 or chunk & (chunk - 1) or chunk > 256):
        raise ValueError(f"chunk_size: expected a power of two from 1 to 256, got {chunk!r}")
    if form is not None:
        plan_.form(form)  # an unknown or illegal form is an error naming it
    if chunk is not None and "chunked" not in legal:
        raise ValueError(f"chunk_size: {chunk} applies to the chunked form only, and {plan_.spec.name} has none "
                         f"(its forms: {', '.join(legal)}); pass chunk_size=None")
    if chunk is not None and form is not None and form != "chunked":
        raise ValueError(f"chunk_size: {chunk} applies to the chunked form only, and form={form!r} was asked for; "
                         f"pass form='chunked' or chunk_size=None")
    if form is not None:
        reason = "asked for"
    elif chunk is not None:
        form, reason = "chunked", f"chunk_size={chunk} asked for"
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
    return Choice(form, size, reason, chunk)  # a chunk size was refused above unless the form is chunked


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


# ---------------------------------------------------------------------------- launch knobs
# What a kernel launch takes that changes its speed and never its results (beyond rounding): chunk
# and tile sizes, warps, software-pipeline stages, registers. The planner owns them: one frozen
# dataclass per kernel family, its defaults (below, with the measurements behind them), the rules
# that fit a value to a call, and the values a search tries. Per call the runtime takes a tuned
# table's launch where one exists (attngen.tuning), else the default; the generated op receives it
# as a list of ints in field order, and the launchers only read it.

# What each knob may be (a value outside is a ValueError naming the knob).
_ALLOWED = {
    "chunk": (lambda x: x in KERNEL_CHUNKS, ", ".join(map(str, KERNEL_CHUNKS))),
    "block": (lambda x: 16 <= x <= 256 and not x & (x - 1), "a power of two from 16 to 256"),
    "warps": (lambda x: x in (1, 2, 4, 8, 16), "1, 2, 4, 8 or 16"),
    "warps_or_off": (lambda x: x in (0, 1, 2, 4, 8, 16), "0 (off) or 1, 2, 4, 8 or 16"),
    "stages": (lambda x: 1 <= x <= 8, "1 to 8"),
    "registers": (lambda x: 32 <= x <= 255, "32 to 255 registers per thread"),
    "flag": (lambda x: x in (0, 1), "0 or 1"),
    "tiles_by": (lambda x: x in (0, 1, 2), "0 (pointers), 1 (the copy engine) or 2 (the copy engine, masked tiles by pointers)"),
    "splits": (lambda x: 1 <= x <= 1024, "1 to 1024"),
    "segments": (lambda x: 0 <= x <= 64, "0 (the policy: kernel_lib.chunked_state_segments) or 1 to 64"),
}


def knob(pass_: str, allowed: str, search: tuple[int, ...], backward: bool = False):
    """A launch dataclass field: the pass whose time it changes (fwd | bwd), what it may be (_ALLOWED)
    and the values a search tries (each fitted to the call before it runs). backward: a forward
    knob that the backward's kernels take too (it changes both passes' times)."""
    return dataclasses.field(metadata={"pass": pass_, "allowed": allowed, "search": search, "backward": backward})


class Launch:
    """Base of the launch dataclasses: the checks, the op's list of ints, the knobs of a pass."""

    # A kernel's tile and warps, which a search also moves together (every combination of their values):
    # one knob moved alone can leave a tile its warps do not hold, spilling registers, where moving two or
    # three at once does not (softmax_causal's dk/dv pass at B4 T8192 H16 D128 bf16: 64 x 64 at four
    # warps, the table's, 255 registers and 164 bytes spilled; 128 x 32 at eight, 253 and none; ptxas on
    # the CPU, BENCHMARKS.md 2026-12-04, twelfth run)
    TILES: ClassVar[tuple[tuple[str, ...], ...]] = ()
    # Knobs a table entry written before them may lack, each with the knob whose value it then takes (a
    # name) or the value itself (an int): the launch the entry was timed with
    INHERITED: ClassVar[dict[str, str | int]] = {}

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            ok, allowed = _ALLOWED[f.metadata["allowed"]]
            if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
                raise ValueError(f"{type(self).__name__}.{f.name}: {value!r} is not allowed; allowed: {allowed}")

    def ints(self) -> list[int]:
        """The knobs in field order: what the generated op takes as `launch`."""
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def describe(self) -> str:
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))

    @classmethod
    def knobs(cls, pass_: str | None = None) -> tuple[str, ...]:
        """The knobs' names in field order: all, or those of one pass (fwd | bwd)."""
        return tuple(f.name for f in dataclasses.fields(cls) if pass_ in (None, f.metadata["pass"]))

    @classmethod
    def tiles(cls, pass_: str) -> tuple[tuple[str, ...], ...]:
        """The knob groups (TILES) a search moves together in a pass: those all of whose knobs it moves there."""
        names = set(cls.searched(pass_))
        return tuple(group for group in cls.TILES if names.issuperset(group))

    @classmethod
    def searched(cls, pass_: str) -> tuple[str, ...]:
        """The knobs a search moves in a pass: fwd its own; bwd (timed as forward + backward, a
        training step) its own and the forward knobs the backward takes too."""
        return tuple(f.name for f in dataclasses.fields(cls)
                     if f.metadata["pass"] == pass_ or (pass_ == "bwd" and f.metadata["backward"]))


@dataclasses.dataclass(frozen=True)
class ChunkedLaunch(Launch):
    """Launch knobs of the chunked linear kernels: the forward's three steps (the chunk-parallel
    prepare step, UT transform or keys; the sequential state pass; the output pass) each with its
    own warps and value blocks, and the backward (which recomputes the chunk-start states at a chunk
    of its own through the forward's prepare and state steps)."""

    chunk: int = knob("fwd", "chunk", KERNEL_CHUNKS)  # tokens per chunk of the forward
    BV: int = knob("fwd", "block", (16, 32, 64, 128), backward=True)  # value lanes of the prepare step's value loop and of the backward's dU step (its dq, dk and UT steps: bwd_dq_BV, bwd_dk_BV, bwd_wy_BV)
    prepare_warps: int = knob("fwd", "warps", (2, 4, 8), backward=True)  # warps of the prepare step (UT transform or keys)
    wu_warps: int = knob("fwd", "warps_or_off", (0, 4), backward=True)  # delta rules: warps of W, U0 and the keys as a kernel of their own after the UT step's inverse (0: in the UT step's kernel)
    states_BV: int = knob("fwd", "block", (16, 32, 64, 128))  # value lanes per program of the state pass
    states_warps: int = knob("fwd", "warps", (2, 4, 8), backward=True)  # warps of the state pass (the backward's recomputation too)
    stages: int = knob("fwd", "stages", (1, 2, 3))  # software-pipeline stages of the forward's state pass
    output_BV: int = knob("fwd", "block", (16, 32, 64, 128))  # value lanes per program of the output pass
    output_warps: int = knob("fwd", "warps", (2, 4, 8))  # warps of the output pass
    maxnreg: int = knob("fwd", "registers", (128, 255), backward=True)  # registers per thread (every chunked kernel)
    segments: int = knob("fwd", "segments", (0, 1, 4, 8, 16), backward=True)  # the sequential passes' segments per sequence, at most (kernel_lib.chunked_state_segments; 0: the policy, 1: none)
    output_in_states: int = knob("fwd", "flag", (0, 1))  # the outputs computed by the forward's state pass, no output pass (planner.output_in_states)
    bwd_chunk: int = knob("bwd", "chunk", KERNEL_CHUNKS)  # tokens per chunk of the backward
    bwd_warps: int = knob("bwd", "warps", (2, 4, 8))  # warps of the backward's dU (or dv: dv_after_states) step and state-gradient pass
    bwd_dq_warps: int = knob("bwd", "warps", (2, 4, 8))  # warps of the backward's dq step (chunked_bwd_dq_kernel)
    bwd_dk_warps: int = knob("bwd", "warps", (2, 4, 8))  # warps of its dk step (chunked_bwd_dk_kernel)
    bwd_wy_warps: int = knob("bwd", "warps", (2, 4, 8))  # delta rules: warps of the backward's UT step (chunked_bwd_wy_kernel)
    bwd_wu_warps: int = knob("bwd", "warps", (2, 4, 8))  # delta rules: warps of W, U0 and the keys from the forward's (I + A)^-1 where the backward reuses it (its chunk divides the forward's)
    bwd_states_BV: int = knob("bwd", "block", (16, 32, 64, 128))  # value lanes per program of the backward's sequential state-gradient pass
    bwd_dq_BV: int = knob("bwd", "block", (32, 64, 128))  # value lanes of the value loop of the backward's dq step (chunked_bwd_dq_kernel)
    bwd_dk_BV: int = knob("bwd", "block", (32, 64, 128))  # value lanes of the value loop of its dk step (chunked_bwd_dk_kernel)
    bwd_wy_BV: int = knob("bwd", "block", (32, 64, 128))  # delta rules: value lanes of the value loop of its UT step (chunked_bwd_wy_kernel)
    bwd_stages: int = knob("bwd", "stages", (1, 2, 3))  # software-pipeline stages of the backward's recomputed state pass
    bwd_ds_stages: int = knob("bwd", "stages", (1, 2, 3))  # the backward's state-gradient pass

    TILES = (("BV", "prepare_warps"), ("states_BV", "states_warps"), ("output_BV", "output_warps"),
             ("bwd_dq_BV", "bwd_dq_warps"), ("bwd_dk_BV", "bwd_dk_warps"), ("bwd_wy_BV", "bwd_wy_warps"))
    # Knobs added since tables were first written, and the knob whose value an entry without them takes (the
    # launch it was timed with): bwd_warps launched the dq and dk steps too; segments 0 is the policy they ran with
    INHERITED = {"bwd_dq_warps": "bwd_warps", "bwd_dk_warps": "bwd_warps", "segments": 0, "output_in_states": 0}


@dataclasses.dataclass(frozen=True)
class SoftmaxLaunch(Launch):
    """Launch knobs of the softmax kernels: the forward and its split of the keys (flash-decoding),
    the backward's dq pass and dk/dv pass."""

    BM: int = knob("fwd", "block", (32, 64, 128))  # query rows per program of the forward
    BN: int = knob("fwd", "block", (32, 64, 128))  # keys per tile of the forward
    warps: int = knob("fwd", "warps", (4, 8))  # warps of the forward
    stages: int = knob("fwd", "stages", (1, 2, 3, 4))  # software-pipeline stages of the forward
    last_first: int = knob("fwd", "flag", (0, 1))  # a head's last query block launches first
    kv_splits: int = knob("fwd", "splits", (1, 2, 4, 8, 16, 32))  # programs sharing one query block's keys
    tma: int = knob("fwd", "flag", (0, 1))  # the forward's key and value tiles by the copy engine (tensor descriptors)
    dq_BM: int = knob("bwd", "block", (64, 128))  # query rows per program of the dq pass
    dq_BN: int = knob("bwd", "block", (32, 64, 128))  # keys per tile of the dq pass
    dq_warps: int = knob("bwd", "warps", (4, 8))  # warps of the dq pass
    dq_stages: int = knob("bwd", "stages", (1, 2, 3))  # software-pipeline stages of the dq pass
    dq_tma: int = knob("bwd", "tiles_by", (0, 1, 2))  # the dq pass's key and value tiles by the copy engine (tensor descriptors; 2: its unmasked tiles)
    dkdv_BN: int = knob("bwd", "block", (64, 128))  # keys per program of the dk/dv pass
    dkdv_BM: int = knob("bwd", "block", (32, 64, 128))  # query rows per tile of the dk/dv pass
    dkdv_warps: int = knob("bwd", "warps", (4, 8))  # warps of the dk/dv pass
    dkdv_stages: int = knob("bwd", "stages", (1, 2, 3))  # software-pipeline stages of the dk/dv pass
    dkdv_tma: int = knob("bwd", "tiles_by", (0, 1, 2))  # the dk/dv pass's query and output-gradient tiles by the copy engine (2: its unmasked tiles)
    dkdv_split: int = knob("bwd", "flag", (0, 1))  # dv and dk in a launch each (one accumulator a program, P formed twice)

    # the backward's copy-engine knobs and the dk/dv split move with their pass's tile: each frees registers
    # for a larger tile (at K = V = 256 the larger tiles spill without them: BENCHMARKS.md 2026-12-05, second run)
    TILES = (("BM", "BN", "warps"), ("dq_BM", "dq_BN", "dq_warps", "dq_tma"),
             ("dkdv_BN", "dkdv_BM", "dkdv_warps", "dkdv_split", "dkdv_tma"))
    # entries written before the split were timed with dk and dv in one launch
    INHERITED = {"dkdv_split": 0}


# The kernel families with launch knobs, by the name tables and `attngen tune` give them.
LAUNCHES: dict[str, type[Launch]] = {"chunked": ChunkedLaunch, "softmax": SoftmaxLaunch}


def parse_knobs(text: str) -> dict[str, int]:
    """'knob=value,...' of the launch dataclasses (LAUNCHES) -> {knob: value} ({} for ''): `attngen tune
    --seed` and the bench scripts' launch overrides. An unknown name or a value not of digits is a
    ValueError naming it; the launch a knob lands in checks its value."""
    names = {n for cls in LAUNCHES.values() for n in cls.knobs()}
    knobs = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if name not in names:
            raise ValueError(f"{name!r} is no launch knob; knobs: {', '.join(sorted(names))}")
        if not sep or not value.isdigit():
            raise ValueError(f"{item!r}: expected knob=value with a non-negative integer value")
        knobs[name] = int(value)
    return knobs


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def lanes(n: int) -> int:
    """A dim padded for the kernels' tiles: a power of two, at least 16 (tl.dot takes no dim below 16)."""
    return max(16, pow2(n))


def kernel_form(spec: Spec, choice: Choice, call: Call) -> tuple[str, int | None]:
    """The kernel form serving a choice, and the chunk the chunked kernels are held to (None: the
    launch's own). The kernels serve recurrent, chunked and bidirectional; the parallel form of a
    causal linear spec runs as one chunk of the chunked kernels (up to the largest chunk)."""
    if not spec.is_linear or spec.mask == "bidirectional":
        return "parallel", None
    if choice.form == "parallel":
        return "chunked", min(KERNEL_CHUNKS[-1], max(KERNEL_CHUNKS[0], pow2(call.max_len)))
    if choice.form == "chunked" and choice.asked_chunk is not None and choice.asked_chunk not in KERNEL_CHUNKS:
        raise ValueError(f"chunk_size: the Triton kernels take {', '.join(map(str, KERNEL_CHUNKS))}, "
                         f"got {choice.asked_chunk}")
    return choice.form, choice.asked_chunk


def launch_family(spec: Spec, form: str = "chunked") -> str | None:
    """The launch family (LAUNCHES) of a spec's kernel form: softmax; chunked for the chunked form of
    causal linear specs; None for the recurrent and bidirectional linear kernels (no knobs yet)."""
    if not spec.is_linear:
        return "softmax"
    return "chunked" if form == "chunked" and spec.mask != "bidirectional" else None


# Registers per thread of every chunked kernel: all a Hopper thread has, stated rather than left to
# ptxas. Without .maxnreg, ptxas -O3 allotted some of them 32 registers and spilled the rest: kda
# bf16 at K = V = 128, 34,280 B in the forward's state pass; the delta-rule backward, 81,948 B in
# fp32 (bench/compile_time.py).
MAXNREG = 255

# Shared memory a loop's software pipeline may fill with prefetched tiles (an H100 / H200 block
# has 227 KiB; the rest is left to the dots' operand staging).
PIPELINE_BYTES = 160 * 1024


def pipeline_stages(stage_bytes: int) -> int:
    """The most num_stages for a loop that loads stage_bytes of tiles per iteration: Triton keeps
    one copy of them in shared memory per stage (at most 3 stages, at least 1: no prefetch)."""
    return max(1, min(3, PIPELINE_BYTES // stage_bytes))


def chunked_stage_bytes(spec: Spec, chunk: int, BF: int, BV: int, dtype: torch.dtype, outputs: bool = False) -> int:
    """The tiles one chunk of the state pass loads: with the delta rule W, the keys transposed and U0,
    else the keys transposed and v; with vector decay also Γ_C [BF] float32. W, U0 and the keys are
    in the generated chunked_pass_dtype: bf16 for bf16 inputs, else float32. outputs: the pass computes
    the outputs too (output_in_states) and loads q [chunk, BF] in the input dtype (and with the delta
    rule k too: its pass's keys are the stored K ⊙ Γ_C/Γ)."""
    tile = 2 if dtype == torch.bfloat16 else 4
    if spec.rule.ut_transform:
        size = chunk * (2 * BF + BV) * tile
    else:
        size = chunk * (BF * tile + BV * dtype.itemsize)
    if outputs:
        size += chunk * BF * dtype.itemsize * (2 if spec.rule.ut_transform else 1)
    return size + (BF * 4 if spec.decay == "vector" else 0)


def bwd_states_stage_bytes(spec: Spec, chunk: int, BF: int, BV: int, dtype: torch.dtype) -> int:
    """The tiles one chunk of the backward's state-gradient pass loads: the decayed keys and the
    queries transposed (in chunked_pass_dtype), and do; the delta rule's W transposed and dU in
    chunked_pass_dtype, the additive rule's dU (dv's local part) in float32. do is in the input
    dtype, do / n in chunked_pass_dtype with normalize sum. With dv_after_states, only the raw
    queries transposed and do."""
    tile = 2 if dtype == torch.bfloat16 else 4
    if dv_after_states(spec):
        # the raw queries transposed and do, both in the input dtype (no keys, no dU: dv_after_states)
        return chunk * (BF + BV) * dtype.itemsize
    if spec.rule.ut_transform:
        return chunk * (3 * BF * tile + BV * (tile + dtype.itemsize))
    return chunk * (2 * BF * tile + BV * (4 + (tile if spec.normalize == "sum" else dtype.itemsize)))


def chunked_launch(spec: Spec, call: Call, dtype: torch.dtype) -> ChunkedLaunch:
    """The default launch of the chunked kernels for a call."""
    BF = lanes(call.feature_dim)
    # the state block [BF, BV] and the [BT, BF] tiles share the registers: narrower value blocks
    # for wide features
    BV = 64 if BF <= 64 else 32
    # Four warps for fp32 and fp16 inputs (tf32 dots): two (64 threads) holding a 64-token chunk's
    # [64, 128] float32 tiles spilled registers and compiled 3x slower. Two for bf16 past 128
    # feature lanes.
    warps = 2 if dtype == torch.bfloat16 else 4
    prepare_warps = states_warps = output_warps = warps
    states_BV = output_BV = BV
    if dtype == torch.bfloat16 and BF <= 128:
        # bf16 at K = V = 128 on the H200 (BENCHMARKS.md 2026-12-01): four warps, the state pass by
        # 64-value blocks and the output pass by 128 (against two warps and 32) took gated_deltanet's
        # passes from 536 and 858 us to 357 and 337, gla's forward from 9.24 to 3.09 ms; 64-token
        # chunks at four warps verified for these steps.
        states_BV, output_BV = 64, 128
        prepare_warps = states_warps = output_warps = 4
        if spec.rule.ut_transform and spec.decay != "vector":
            # The UT step of scalar-decay and plain delta rules stays at two warps: its 64-row
            # 16-bit dots are those Triton 3.6 miscompiled at four (and at four it took 1126 us
            # against 679).
            prepare_warps = 2
    # The backward (it recomputes its states at a chunk of its own): 32-token chunks, four warps and
    # three stages but where the case below measured otherwise. kda fp32 at K = V = 128:
    # - two warps at 64-token chunks spilled 51,924 B even at 255 registers, and the GPU ran
    #   out of local memory for them;
    # - four warps at 64-token chunks asked for 245,760 B of shared memory (the H200 has 232,448);
    # - four warps at 32-token chunks: 98,304 B of shared memory, 14,068 B spilled. Their dots
    #   have 32 rows, below the 64-row wgmma tiles that Triton 3.6 miscompiled in 16-bit at K = V = 128.
    bwd_chunk, bwd_stages = 32, 3
    if (dtype == torch.bfloat16 and not spec.rule.ut_transform and spec.decay != "vector"
            and spec.feature_map != "favor_plus" and spec.qk_norm == "none" and BF <= 128
            and lanes(call.value_dim) <= 128):
        # No, scalar and constant decay (Linear Transformer, Mamba2, RetNet): the additive rules'
        # backward in bf16 at four warps, 64-token chunks and no software pipelining of its two state
        # passes: B4 T8192 H16 K = V = 128 fwd+bwd on the H200, mamba2 3.563 -> 2.723 ms, retnet 3.499
        # -> 2.681 (half the chunk-start states and state gradients to write and read, half the
        # sequential steps; bench/probe_launch.py, BENCHMARKS.md); linear_transformer (elu+1, the sum
        # normalizer) 4.186 -> 3.634 since its states are bf16 (its normalizer's column apart; 7.39 ->
        # 7.92 before, with float32 states). Not where it measured slower: vector decay (gla 8.61 ->
        # 16.42, its dq/dk steps), FAVOR+ (performer 51.4 -> 55.8). The delta rules' backward at 64
        # tokens and four warps gave NaN gradients and illegal addresses (Triton 3.6's 64-row wgmma
        # miscompile), at eight warps right but slower.
        bwd_chunk, bwd_stages = 64, 1
    # Vector decay (KDA) in bf16, B4 T8192 H16 K = V = 128 on the H200 (BENCHMARKS.md 2026-12-02): W, U0
    # and the keys as a kernel of their own at four warps took the UT steps of one training step
    # (the forward's at 16-token chunks, the backward's at 32) from 4011 to 1580 us, the backward's
    # UT step (chunked_bwd_wy_kernel) at eight warps 5769 -> 4019 us, where the backward's other
    # kernels are faster at four: fwd+bwd 18.90 -> 16.11 ms. Not for the scalar-decay and plain
    # delta rules: their fused UT step was faster (642 against 773 us at 64-token chunks), their
    # backward's UT step at eight warps slower (gated_deltanet 6.33 -> 7.11 ms, deltanet 4.55 -> 4.86).
    wu_warps, bwd_wy_warps = (0, 4)
    if dtype == torch.bfloat16 and spec.rule.ut_transform and spec.decay == "vector":
        wu_warps, bwd_wy_warps = 4, 8
    # The backward's W, U0 and keys from the forward's (I + A)^-1 (where its chunk divides the
    # forward's) at two warps: B4 T8192 H16 K = V = 128 bf16 on the H200, fwd+bwd gated_deltanet 5.826
    # ms at four, 5.793 at two, 5.856 at eight; deltanet 4.070, 4.046, 4.075 (BENCHMARKS.md 2026-12-02, fifth run).
    # Four for the other dtypes, as the UT step's (their tf32 dots' float32 tiles)
    bwd_wu_warps = 2 if dtype == torch.bfloat16 else 4
    # The value loops of the backward's dq, dk and UT steps. bf16 delta rules at K = V = 128 on the
    # H200 (B4 T8192 H16, fwd+bwd, BENCHMARKS.md 2026-12-02, sixth run): dq and the UT step by 128
    # lanes, gated_deltanet 5.615 -> 5.213 ms (dq 731 -> 493 us, UT step 1054 -> 876), deltanet 4.030
    # -> 3.931, kda 12.605 -> 12.443; dk by 128 too (deltanet 452 -> 365 us, kda 2686 -> 1695; gated_deltanet's,
    # 1211 us at 32 lanes with the decay gradient's chunk term in its loop, 603 at 128 with the term out of
    # it; BENCHMARKS.md 2026-12-04). The additive rules measured best at BV (mamba2, retnet, gla,
    # linear_transformer).
    # Step 4 in one kernel (fused_dq_dk) by 64 lanes at four warps: gated_deltanet 1091 us against 1832 by
    # 128, 1135 by 32, 1568 at eight warps by 64; deltanet 796 against 870, 886, 1198 (bf16 B4 T8192 H16 K
    # = V = 128 on the H100, BENCHMARKS.md 2026-12-06, fourth run; before its raw tiles moved ahead of its loop,
    # after which the H100 search took 32 lanes with other knobs: the lanes alone not measured since).
    # Past 128 feature lanes it takes eight warps (its three [BT, 256] float32 accumulators: 1580 B spilled at
    # four, 108 at eight; CPU ptxas, bench/compile_time.py --h100 --bwd --D 256).
    bwd_dq_BV = bwd_dk_BV = bwd_wy_BV = BV
    bwd_dq_warps = 8 if fused_dq_dk(spec) and BF > 128 else 4
    if dtype == torch.bfloat16 and spec.rule.ut_transform and BF <= 128:
        bwd_dq_BV = bwd_dk_BV = bwd_wy_BV = 128
        if fused_dq_dk(spec):
            bwd_dq_BV = 64
    if fused_dq_dk(spec) and bwd_chunk == 64:
        # The additive rules' step 4 in one kernel at their 64-token backward chunks: eight warps by 64 lanes
        # (its [64, 128] and [64, 64] float32 accumulators: 0 B spilled for mamba2 at K = V = 128, 1368 B at four
        # warps; Triton 3.6's ptxas). bf16 B4 T8192 H16 on an H100, against the dq and dk steps: mamba2 698 us
        # against 466 + 425, by 32 lanes 855; linear_transformer 810 against 481 + 500, by 32 lanes 927
        # (BENCHMARKS.md 2026-12-07, twelfth run).
        bwd_dq_warps, bwd_dq_BV = 8, min(BV, 64)
    # The forward's chunk: 32 tokens in bf16 past 128 feature lanes (two warps, [BT, 256] tiles), where
    # measured faster. B2 T8192 H8 K = V = 256 on the H200 (bench/probe_launch.py, BENCHMARKS.md
    # 2026-12-04, tenth run), fwd and fwd+bwd ms: gated_deltanet 2.885 -> 1.147 and 6.796 -> 5.040 (the
    # output pass 1866 -> 485 us, the state pass 1199 -> 945), deltanet 2.053 -> 1.041 and 4.814 -> 3.806,
    # mamba2 1.419 -> 0.726 and 4.275 -> 3.574, retnet 1.508 -> 0.668 and 4.656 -> 3.837,
    # linear_transformer 3.676 -> 1.628 and 7.896 -> 5.852, gla 5.678 -> 1.477 and 12.242 -> 8.003 (16
    # tokens: 1.641), kda 8.349 -> 2.318 and 17.888 -> 11.851, performer 7.968 -> 5.457 and 19.883 -> 17.281.
    chunk = 32 if dtype == torch.bfloat16 and BF > 128 else DEFAULT_CHUNK
    # The outputs in the state pass (output_in_states) for bf16 up to 128 feature lanes, the pass (and the
    # backward's recomputation) then by 32 value lanes at four warps. B4 T8192 H16 K = V = 128 bf16 on the H100
    # (bench/probe_launch.py, BENCHMARKS.md 2026-12-06, fifth run), forward ms: retnet 0.503 (the two passes,
    # the table's launch) -> 0.487 (the outputs in the pass at the table's 64 lanes and eight warps) -> 0.426 (32
    # lanes, four warps), mamba2 0.510 -> 0.480 -> 0.432; B1 T32768 retnet 0.615 -> 0.597 -> 0.568, mamba2
    # 0.618 -> 0.588 -> 0.570; forward + backward unchanged or faster. At 64 lanes and four warps it spills
    # (176 B, ptxas). Not timed for other dtypes or widths: off there.
    # The delta rules' (U = U0 - W S_c in the pass; BENCHMARKS.md 2026-12-06, eighth run, the same shapes): by 64
    # lanes at four warps, deltanet 0.983 -> 0.918 ms forward at B4 T8192 and 1.342 -> 1.248 at B1 T32768 (forward +
    # backward 3.817 -> 3.723 and 5.047 -> 4.896); by 32 lanes and by 64 at eight warps slower. With a decay the
    # pass's own cumulative log decays and score ratios cost more than the output pass it replaces: gated_deltanet
    # 1.044 -> 1.278 and 1.401 -> 1.527. So off there.
    outputs = int(output_in_states(spec, dtype) and dtype == torch.bfloat16 and BF <= 128
                  and (not spec.rule.ut_transform or spec.decay == "none"))
    if outputs:
        states_BV, states_warps = (64, 4) if spec.rule.ut_transform else (32, 4)
    return fit_chunked(spec, call, dtype, ChunkedLaunch(
        chunk=chunk, BV=BV, prepare_warps=prepare_warps, wu_warps=wu_warps, states_BV=states_BV,
        states_warps=states_warps, stages=3, output_BV=output_BV, output_warps=output_warps,
        maxnreg=MAXNREG, segments=0, output_in_states=outputs,
        bwd_chunk=bwd_chunk,
        bwd_warps=4,
        bwd_dq_warps=bwd_dq_warps,
        bwd_dk_warps=4,
        bwd_wy_warps=bwd_wy_warps,
        bwd_wu_warps=bwd_wu_warps,
        bwd_states_BV=BV,
        bwd_dq_BV=bwd_dq_BV,
        bwd_dk_BV=bwd_dk_BV,
        bwd_wy_BV=bwd_wy_BV,
        bwd_stages=bwd_stages,
        bwd_ds_stages=bwd_stages,
    ))


def fit_chunked(spec: Spec, call: Call, dtype: torch.dtype, launch: ChunkedLaunch,
                chunk: int | None = None) -> ChunkedLaunch:
    """A launch held to what a call can take (a default, a table's from another shape, a search's
    candidate); chunk: the chunk the call is held to (the caller's chunk_size, or the parallel
    form's one chunk), the backward's at most that."""
    BF = lanes(call.feature_dim)
    if chunk is not None:
        launch = dataclasses.replace(launch, chunk=chunk, bwd_chunk=min(chunk, launch.bwd_chunk))
    fwd_chunk, bwd_chunk = launch.chunk, launch.bwd_chunk
    if dtype == torch.float32 and BF > 128:
        # At 64, the output pass's tf32x3 dots of [64, 256] tiles asked for 262,144 B of shared
        # memory (the H200 has 232,448; bench/compile_time.py); the outputs do not depend on the chunk.
        # Vector decay's output pass (a dot per 16-token block pair) asked for 331,776 B at 32 (kda
        # and gla, D = 256 on the H200) and takes 65,536 B at 16.
        fwd_chunk = min(fwd_chunk, 16 if spec.decay == "vector" else 32)
    if dtype == torch.bfloat16:
        # Triton 3.6 miscompiled the 64-row wgmma dots of bf16 operands on the H200 at K = V = 128
        # (wrong outputs, illegal addresses; BENCHMARKS.md) in the UT step of scalar-decay and plain
        # delta rules and in the delta rules' backward: at four warps or more (a warpgroup: the dots
        # go to wgmma) these take chunks of at most 32 tokens, whose dots have 32 rows. The
        # forward's other steps and the additive rules' backward were verified at 64-token chunks
        # and four warps.
        if spec.rule.ut_transform and spec.decay != "vector" and max(launch.prepare_warps, launch.wu_warps) >= 4:
            fwd_chunk = min(fwd_chunk, 32)
        if spec.rule.ut_transform and max(launch.bwd_warps, launch.bwd_dq_warps, launch.bwd_dk_warps,
                                          launch.bwd_wy_warps, launch.bwd_wu_warps) >= 4:
            bwd_chunk = min(bwd_chunk, 32)
    output_BV = launch.output_BV
    if dtype == torch.bfloat16 and spec.normalize == "sum":
        # The output pass of the sum normalizer in bf16 at 16 and at 32 value lanes (the state pass
        # at eight warps): illegal addresses on the H200 (Triton 3.6, linear_transformer B4 T8192
        # H16 K = V = 128, `attngen tune`); only the default's 128 lanes are verified
        output_BV = max(output_BV, 128)
    states_BV = launch.states_BV
    if dtype == torch.bfloat16 and BF <= 128:
        # Illegal addresses on the H200 (Triton 3.6, gated_deltanet bf16 at B2 and B16 T8192 K = V = 128
        # and B16 T8192 K = V = 64, `attngen tune`; each launch alone in bench/probe_launch.py --isolate,
        # BENCHMARKS.md 2026-12-04, ninth run): the output pass at 16 value lanes, and the delta rule's
        # state pass at one stage and 32 value lanes. Their outputs are right in Triton's interpreter.
        # Held to the verified widths: 64 value lanes and more (the defaults' 128 and 64)
        output_BV = max(output_BV, 64)
        if spec.rule.ut_transform and launch.stages == 1:
            states_BV = max(states_BV, 64)
    V = lanes(call.value_dim)
    bwd_states_BV = launch.bwd_states_BV
    if spec.rule.ut_transform:
        states_BV = segment_lanes(call, launch, states_BV, fwd_chunk)
        bwd_states_BV = segment_lanes(call, launch, bwd_states_BV, bwd_chunk)
    if not spec.rule.ut_transform:
        # the knobs of the delta rules' UT steps: no kernel of an additive rule takes them
        launch = dataclasses.replace(launch, wu_warps=0, bwd_wy_warps=4, bwd_wu_warps=2, bwd_wy_BV=launch.BV)
    if fused_dq_dk(spec):
        # step 4 in one kernel at the dq step's knobs: the dk step's move no kernel, and a search does not try them
        launch = dataclasses.replace(launch, bwd_dk_warps=launch.bwd_dq_warps, bwd_dk_BV=launch.bwd_dq_BV)
    if keys_in_passes(spec):
        # no prepare step (keys_in_passes): its warps move no kernel, and a search does not try them
        launch = dataclasses.replace(launch, prepare_warps=4)
    if not output_in_states(spec, dtype):
        launch = dataclasses.replace(launch, output_in_states=0)
    elif launch.output_in_states:
        # no output pass: its knobs move no kernel (held at the states pass's, which a search moves)
        output_BV, launch = states_BV, dataclasses.replace(launch, output_warps=launch.states_warps)
    return fit_stages(spec, call, dtype, dataclasses.replace(
        launch, chunk=fwd_chunk, BV=min(launch.BV, V), states_BV=min(states_BV, V),
        output_BV=min(output_BV, V), bwd_states_BV=min(bwd_states_BV, V), bwd_dq_BV=min(launch.bwd_dq_BV, V),
        bwd_dk_BV=min(launch.bwd_dk_BV, V), bwd_wy_BV=min(launch.bwd_wy_BV, V), bwd_chunk=bwd_chunk))


def segment_lanes(call: Call, launch: ChunkedLaunch, BV: int, chunk: int) -> int:
    """The value blocks of a delta rule's state pass (forward or backward, at `chunk`): where its
    sequences split into segments (kernel_lib.chunked_state_segments: its programs leave SMs idle, or
    the launch asks), at least 64 lanes. Its first launch runs M's column blocks (F / BV programs)
    beside the values' own, so narrower blocks double that work: gated_deltanet B1 T32768 H16 bf16
    fwd+bwd 5.213 ms at 8 segments of 64 lanes against 6.067 at 16 of 32 (H200), and 5.978 against
    6.721 with the backward's pass at 5 of 32 (H100; BENCHMARKS.md 2026-12-05, fourth run)."""
    from .kernel_lib import chunked_state_segments
    wide = min(64, lanes(call.value_dim))
    if BV >= wide or call.varlen:
        return BV
    programs = call.num_seqs * call.heads * -(-call.value_dim // BV)
    return wide if chunked_state_segments(programs, call.q_len, chunk, launch.segments)[0] > 1 else BV


def fit_stages(spec: Spec, call: Call, dtype: torch.dtype, launch: ChunkedLaunch) -> ChunkedLaunch:
    """A launch's pipeline stages held to the shared memory its state passes' tiles take at its
    chunks and value blocks (pipeline_stages)."""
    BF = lanes(call.feature_dim)
    stages = lambda chunk, outputs=False: pipeline_stages(  # noqa: E731
        chunked_stage_bytes(spec, chunk, BF, launch.states_BV, dtype, outputs))
    ds_stages = pipeline_stages(bwd_states_stage_bytes(spec, launch.bwd_chunk, BF, launch.bwd_states_BV, dtype))
    return dataclasses.replace(
        launch, stages=min(launch.stages, stages(launch.chunk, bool(launch.output_in_states))),
        bwd_stages=min(launch.bwd_stages, stages(launch.bwd_chunk)),
        bwd_ds_stages=min(launch.bwd_ds_stages, ds_stages))


def _softmax_lens(call: Call) -> tuple[int, int]:
    """The longest query and key sequences of a call (the packed sequences' longest with cu_seqlens)."""
    return (call.max_len, call.max_len) if call.varlen else (call.q_len, call.k_len)


def softmax_launch(call: Call, dtype: torch.dtype, sms: int, decay: bool = False) -> SoftmaxLaunch:
    """The default launch of the softmax kernels for a call on a GPU of `sms` multiprocessors; `decay`
    for specs whose scores carry a cumulative log-decay bias (forgetting attention)."""
    BK, BV = lanes(call.head_dim), lanes(call.value_dim)
    size, acc = dtype.itemsize, (8 if dtype == torch.float64 else 4)
    max_q, max_k = _softmax_lens(call)
    # The forward: the query tile within 32 KiB and a stage of key + value tiles within 64 KiB of
    # shared memory; rows capped by the longest sequence. 16-bit inputs up to 128 lanes: 64 x 64
    # tiles, four warps, three stages, the fastest of 36 configurations on the H200 (softmax_causal
    # B4 T8192 H16 D128 bf16: 2.34 ms, against 3.88 ms at eight warps and two stages; BENCHMARKS.md).
    # A head's last query block launches first (2.49 against 2.66 ms).
    # 16-bit inputs past 128 lanes: the query tile within 64 KiB, 128 x 256 at eight warps, as the tuned
    # entries at 256 lanes took (softmax_causal B16 T8192 H8 D256 bf16 on the H100: 17.47 -> 8.99 ms;
    # BENCHMARKS.md 2026-12-05, fourth run)
    wide16 = size == 2 and max(BK, BV) > 128
    BM = min(128 if wide16 else 64, max(16, _pow2_floor((65536 if wide16 else 32768) // (BK * size))), lanes(max_q))
    BN = min(64, max(16, _pow2_floor(65536 // ((BK + BV) * size))))
    if size == 2 and max(BK, BV) <= 128:
        warps, stages = 4, 3
    else:
        warps, stages = 4 if max(BK, BV) <= 64 else 8, 2
    last_first = 1
    # A decay bias adds the key tiles' cumulative gates to each stage: at 64 x 64 and three stages the forward
    # then takes 116,760 B of shared memory, one program per multiprocessor (softmax_causal's 115,712 B fit
    # two). 16-bit inputs of 65 to 128 lanes: 128-key tiles in one stage, launched in order (82,944 B, two
    # per multiprocessor), as every tuned H200 entry of forgetting_attention at 128 lanes took (B2, B4, B16
    # T8192 H16 D128 bf16: forward 3.11 -> 1.62, 5.83 -> 3.07, 24.37 -> 11.98 ms; attngen/tables); up to 64
    # lanes, 128-query blocks (2.93 -> 2.30 ms at B2 T8192 H32 D64). A decode's query blocks (BM 16) leave
    # room for three stages of 64-key tiles (72,728 B, three programs per multiprocessor), as softmax_causal's
    # tuned decode launches take: forgetting attention's decode step (one query against 32768 keys, B1 bf16
    # H16 D128, the append inside the forward) 117.0 us of forward kernel on the H100 at 128-key tiles in one
    # stage, 80.5 us at these on the H200, where the forward at 128-key tiles took 91.0 with its append
    # launched apart (BENCHMARKS.md 2026-12-07, sixteenth run)
    decay128 = decay and size == 2 and 64 < max(BK, BV) <= 128
    if decay128 and BM >= 64:
        BN, stages, last_first = 128, 1, 0
    elif decay and size == 2 and max(BK, BV) <= 64:
        BM = min(128, lanes(max_q))
    programs = -(-max_q // BM) * call.num_seqs * call.heads
    # The streamed tiles by the copy engine (tensor descriptors; fit_softmax holds them to 16-bit inputs,
    # and the launchers fall back to pointers where tile_descriptor cannot take a tensor: head dims not a
    # power of two, a cache's ring): on the H200, B4 T8192 H16 D128 bf16, softmax_causal's forward 2.785 ->
    # 2.369 ms, sliding_window 1024's 0.781 -> 0.677, forgetting_attention's 3.999 -> 3.495 (BENCHMARKS.md
    # 2026-12-04, fourth run)
    tma = 1
    # The backward: a program's block holds its resident tiles and two float32 (float64)
    # accumulators of BK + BV columns within 64 KiB of registers; a stage of the inner tiles it
    # streams (BK + BV columns in the input dtype) within 32 KiB of shared memory. 16-bit inputs up
    # to 128 lanes take the fastest of 36 configurations per kernel on the H200 (softmax_causal B4
    # T8192 H16 D128 bf16; BENCHMARKS.md): dq 128-query blocks and 128-key tiles at eight warps,
    # dk/dv 64-key blocks and 64-query tiles at four warps, two stages each (forward + backward
    # 11.2 ms, from 19.9 ms). 16-bit inputs past 128 lanes: 64 x 64 at eight warps for both, the masked
    # tiles by pointers (tma 2) and dk, dv in launches of their own, against 32 x 32 from the budgets below
    # (softmax_causal B16 T8192 H8 D256 bf16 on the H200: dq 68.8 -> 23.8 ms, dk/dv 78.5 -> 49.8; ptxas:
    # none spilled, where dk/dv in one launch spills 1580 B; BENCHMARKS.md 2026-12-05, fourth run).
    bwd = {}
    for kernel, cap in (("dq", lanes(max_q)), ("dkdv", lanes(max_k))):
        if wide16:
            block, tile, bwd_warps = min(64, cap), min(64, cap), 8
        elif decay128:
            # the tuned H200 entries of forgetting_attention at 128 lanes (backward at B4 T8192 H16 D128
            # bf16: 21.19 -> 13.92 ms): 64-key dq tiles, 32-query dk/dv tiles
            block, tile, bwd_warps = (128, 64, 8) if kernel == "dq" else (64, 32, 4)
            block, tile = min(block, cap), min(tile, cap)
        elif size == 2:
            block, tile, bwd_warps = (128, 128, 8) if kernel == "dq" else (64, 64, 4)
            block, tile = min(block, cap), min(tile, cap)
        else:
            block = min(128, cap, max(16, _pow2_floor(65536 // ((BK + BV) * acc))))
            tile = min(64, cap, max(16, _pow2_floor(32768 // ((BK + BV) * size))))
            bwd_warps = 8 if block * (BK + BV) > 4096 else 4
        bwd[kernel] = block, tile, bwd_warps, 2
    return fit_softmax(call, dtype=dtype, launch=SoftmaxLaunch(
        BM=BM, BN=BN, warps=warps, stages=stages, last_first=last_first,
        kv_splits=1 if call.varlen else softmax_kv_splits(programs, call.k_len, BN, sms), tma=tma,
        dq_BM=bwd["dq"][0], dq_BN=bwd["dq"][1], dq_warps=bwd["dq"][2], dq_stages=bwd["dq"][3],
        dq_tma=2 if wide16 else tma, dkdv_BN=bwd["dkdv"][0], dkdv_BM=bwd["dkdv"][1], dkdv_warps=bwd["dkdv"][2],
        dkdv_stages=bwd["dkdv"][3], dkdv_tma=2 if wide16 else tma, dkdv_split=int(wide16),
    ))


def softmax_kv_splits(programs: int, Tk: int, BN: int, sms: int) -> int:
    """Programs sharing each query block's keys. Split-KV (flash-decoding) when the query blocks give
    fewer programs than the GPU has multiprocessors (decode: a few queries against a long cache):
    enough splits of at least two key tiles each for two programs per multiprocessor."""
    if programs >= sms:
        return 1
    return max(1, min(-(-2 * sms // programs), -(-Tk // (2 * BN))))


def fit_softmax(call: Call, launch: SoftmaxLaunch, dtype: torch.dtype) -> SoftmaxLaunch:
    """A launch held to what a call can take: blocks no longer than the longest sequence they
    tile, the keys split in at most as many parts as they have tiles, packed calls unsplit (the
    split forward reads dense sequences), the copy engine's tiles for 16-bit inputs only (others
    load by pointers whatever the knobs say: a search need not time them)."""
    q_cap, k_cap = (lanes(n) for n in _softmax_lens(call))
    copy_engine = int(dtype.itemsize == 2)
    return dataclasses.replace(
        launch, BM=min(launch.BM, q_cap),
        kv_splits=1 if call.varlen else min(launch.kv_splits, -(-call.k_len // launch.BN)),
        tma=launch.tma & copy_engine,
        dq_BM=min(launch.dq_BM, q_cap), dq_BN=min(launch.dq_BN, q_cap), dq_tma=launch.dq_tma * copy_engine,
        dkdv_BN=min(launch.dkdv_BN, k_cap), dkdv_BM=min(launch.dkdv_BM, k_cap), dkdv_tma=launch.dkdv_tma * copy_engine)


def default_launch(family: str, spec: Spec, call: Call, dtype: torch.dtype, sms: int) -> Launch:
    """The default launch of a kernel family (LAUNCHES) for a call on a GPU of `sms` multiprocessors."""
    if family == "chunked":
        return chunked_launch(spec, call, dtype)
    return softmax_launch(call, dtype, sms, decay=spec is not None and spec.decay == "scalar")


def fit_launch(family: str, spec: Spec, call: Call, dtype: torch.dtype, launch: Launch,
               chunk: int | None = None) -> Launch:
    """A launch of a kernel family held to what a call can take (fit_chunked, fit_softmax)."""
    if family == "chunked":
        return fit_chunked(spec, call, dtype, launch, chunk)
    return fit_softmax(call, launch, dtype)
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
    elif not spec.rule.ut_transform:
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


def check_ranks(ranks: int, length: int) -> None:
    """Context parallelism gives every rank a shard of at least one token."""
    if ranks > length:
        raise ValueError(f"--ranks: {ranks} ranks over T={length} tokens leave ranks without a token; "
                         f"at most {length} (one token per rank)")


def explain_parallel(spec: Spec, ranks: int, batch: int, length: int, heads: int, head_dim: int,
                     value_dim: int, input_bytes: int = 2) -> str:
    """The context-parallel plan over `ranks` equal shards of `length` tokens, and its bytes per
    rank (states in float32, keys and values of `input_bytes` each)."""
    check_ranks(ranks, length)
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
    launch_knobs: tuple[tuple[str, tuple[str, ...]], ...]   # (pass, knobs) of its LAUNCHES dataclass, in field order
    decay_span: float               # vector decay: a chunk's (16-token block's) scores in one dot while its decay spans <= this
    decay_span_gamma: str           # exp(-decay_span), the literal: a chunk's Γ_C at that span
    ut_inverse: str                 # the delta rule's UT step: how it inverts its diagonal 16-token blocks (ut_inverse)
    chunked_fwd_steps: tuple[str, ...]  # the chunked forward's step kernels in launch order (chunked_steps), each
                                        # rendered from templates/chunked/<step>.py.jinja
    chunked_bwd_steps: tuple[str, ...]  # the chunked backward's own step kernels in launch order, each rendered
                                        # from templates/chunked_bwd/<step>.py.jinja (the forward's it recomputes apart)
    stored_features: bool           # the output passes and the backward's step 2 read stored features of the keys
                                    # (kr) and queries (qg) rather than projecting k and q again (stored_features)
    stored_grad_features: bool      # the backward's dq and dk steps read them too (stored_grad_features)
    keys_in_passes: bool            # the additive rule's state passes read each chunk's keys from k, raw, the decay on
                                    # their dots' other side: no keys step (keys_in_passes)
    output_in_states: bool          # the forward's state pass can compute the outputs (output_in_states), as a launch asks
    states_decay_ahead: bool        # the forward's state pass loads each chunk's Γ_C an iteration ahead (states_decay_ahead)
    dv_after_states: bool           # the additive rule's backward: the state-gradient pass reads q, then a dv step
                                    # reads its dS (dv_after_states)
    rule_hook: hooks.AdditiveRule | None  # the update rule's Triton fragments for the step templates (linear specs)
    decay_hook: hooks.NoDecay       # the decay's
    feature_hook: hooks.FeatureMap  # the feature map's (identity for softmax specs)
    mask_hook: hooks.Mask | None    # a softmax spec's mask, as a tile on its edge applies it (softmax specs)
    bias_hook: hooks.ScoreBias | None  # a softmax spec's bias on the scores (softmax specs)


# Vector decay: a 16-token block's pair scores sum_f x_tf y_sf exp(G_tf - G_sf) (s <= t) are one dot of
# X ⊙ exp(G) and Y ⊙ exp(-G), G the log decay cumulated from the block's start, when the block's
# decay G_B spans at most this in every feature: the factors stay within e^±40 (fp32 and bf16 reach
# e^88; a term x_t y_s of 1e-21 or more keeps normal operands). The backward's pair sums inside a block
# (dq̂, dk̂, P^T, the delta rule's K K^T) take the same dots and the same test, per chunk. Past it, the
# kernels take the pairs by offsets t - s, each factor the exp of a sum of log decays (<= 1), exact for
# any decay. The forward's output pass applies the test to the whole chunk (its Γ_C, stored by the keys
# or UT step): within it, the chunk's pairs are one dot; past it, chunked_output_blocks_kernel takes the
# chunk by blocks.
DECAY_SPAN = 40.0



def ut_inverse(spec: Spec) -> str:
    """How the delta rule's UT step inverts the diagonal 16 x 16 blocks of I + A ("" without the
    rule): "doubling" (X - X C X over blocks of 2, 4, 8, 16 rows, six dots, chunked_solve_dot) with vector
    decay, "substitution" (16 dependent rows) otherwise. Which is faster depends on the kernel around
    it (the H200 at K = V = 128 bf16, bench/probe_ut.py): kda's step 1095 against 1439 us at 16-token
    chunks and 2770 against 3003 at 32; gated_deltanet's 1110 against 593 at 64."""
    if not (spec.is_linear and spec.rule.ut_transform):
        return ""
    return "doubling" if spec.decay == "vector" else "substitution"


def stored_features(spec: Spec) -> bool:
    """Whether the chunked kernels reuse stored features rather than project q and k again: the output
    passes and the backward's step 2 read the keys' features the keys step stored (kr); with the sum
    normalizer the backward's output pass stores the queries' features (qg) and step 2 reads them, in
    rows and transposed, without the normalizer step 2 reads its own back (past a barrier) for P^T.
    FAVOR+ without decay: each featurized tile there costs a projection of [BT, K] by the random
    features (three dots at tf32x3) and a layout of them in registers, where a stored tile is one
    load; without decay kr holds the features themselves (with a decay, K ⊙ Γ_C/Γ), and the scores'
    dots round them to the dots' dtype as the store did."""
    return spec.is_linear and spec.feature_map == "favor_plus" and spec.decay == "none" and not spec.rule.ut_transform


def keys_in_passes(spec: Spec) -> bool:
    """Whether the additive rule's sequential passes (the forward's chunk-start states, the backward's
    recomputed ones and its state gradient) read each chunk's keys from k, raw, rather than the keys
    step's stored K ⊙ Γ_C/Γ (chunked_keys_kernel, then not launched): the keys as loaded are the dots'
    operand (Triton stages the load in shared memory for the dot and prefetches it with the loop's
    other tiles, as it did the stored keys), the chunk's decays are computed in the loop from g and
    Γ_C/Γ scales the dot's other side (the forward's values, the rows of the backward's K dS). The same
    bytes per chunk; the keys step's read of k, write of the keys and launch are gone from the forward
    and from the backward's recomputation. B4 T8192 H16 K = V = 128 bf16 on the H200 (BENCHMARKS.md
    2026-12-03, fourth run): mamba2 fwd 0.521 -> 0.429 ms, fwd+bwd 2.386 -> 2.273; retnet 0.511 -> 0.415,
    2.322 -> 2.110; the state-gradient pass loads a scalar decay's next chunk of g an iteration ahead (a
    narrow load the software pipeline left in place): mamba2's pass 520 -> 445 us, fwd+bwd 2.181. Only
    raw keys: no feature map, l2 norm or normalizer. Featurized keys go through registers before the
    dot, unstaged: linear_transformer (elu+1, the sum normalizer) measured 0.661
    -> 0.830 ms forward, 3.614 -> 4.463 fwd+bwd with them in its loops. Nor FAVOR+ (its stored features
    serve the output passes too, stored_features) or vector decay (its decays a [BT, F] tile)."""
    return (spec.is_linear and spec.mask != "bidirectional" and not spec.rule.ut_transform
            and spec.decay in ("none", "scalar", "constant") and spec.feature_map == "identity"
            and spec.qk_norm == "none" and spec.normalize == "none")


def output_in_states(spec: Spec, dtype: torch.dtype | None = None) -> bool:
    """Whether the forward's state pass can compute the outputs as it walks the chunks (a launch's
    output_in_states asks it): O = (Q ⊙ Γ) S_c + P U of each chunk from its start state S_c in registers,
    rather than storing every S_c for a chunk-parallel output pass to read back. The chunk-start states
    are the forward's largest traffic (B4 T8192 H16 K = V = 128 bf16: 268 MB written and read again,
    against 134 MB for each of q, k, v and o); the pass then also reads q and computes each chunk's
    scores, on its B·H·V/BV programs rather than the output pass's one per chunk. The specs of
    keys_in_passes (the pass loads each chunk's raw keys and decays already: the scores need only q), and
    the delta rules without vector decay or FAVOR+: their pass holds U = U0 - W S_c of each chunk (written
    back for the output pass otherwise, 134 MB more each way at that shape) and loads q, k and the log
    decays for the scores, featurized (an elementwise map, the l2 norm) as the output pass does. With a
    dtype: whether a call of it can (the delta rules' for bf16 inputs only: float32 tiles of W, the keys,
    q, k and U0 asked for 262,144 B of shared memory at 128 value lanes, above the H100's and H200's
    232,448, and spilled 1.4 and 2.4 KB at 32 and 64; Triton 3.6's ptxas, bench/compile_time.py)."""
    delta = (spec.is_linear and spec.mask != "bidirectional" and spec.rule.ut_transform
             and spec.decay in ("none", "scalar", "constant") and spec.feature_map != "favor_plus"
             and spec.normalize == "none")
    if delta and dtype is not None:
        return dtype == torch.bfloat16
    return keys_in_passes(spec) or delta


def dv_after_states(spec: Spec) -> bool:
    """Whether the additive rule's backward walks the state gradient before its dv step: the sequential
    pass reads each chunk's queries from q, raw, with its decays from g (as keys_in_passes reads the keys)
    and only walks dS <- Γ_C dS + (Q ⊙ Γ)^T dO, storing dS per chunk; a chunk-parallel step after it
    computes dv = P^T dO + (K ⊙ Γ_C/Γ) dS in one program per chunk. Otherwise a chunk-parallel step
    before the pass stores the local dU = P^T dO (float32) and the queries Q̂ ⊙ Γ, and the pass adds
    (K̂ ⊙ Γ_C/Γ) dS to each chunk's dU: a second dot and a [BT, BV] float32 load per chunk on the
    sequential pass, and 6 bytes per token and lane of dU and queries written and read again. The same
    specs as keys_in_passes (raw queries and keys: no feature map, l2 norm or normalizer)."""
    return keys_in_passes(spec)


def states_decay_ahead(spec: Spec) -> bool:
    """Whether the forward's state pass loads each chunk's stored Γ_C an iteration ahead (a narrow load
    that Triton's software pipeline leaves in place, on the loop's critical path S <- Γ_C S + ..), as
    the backward's state-gradient pass does: the additive rules with a stored Γ_C (a decay, and not
    keys_in_passes). B4 T8192 H16 K = V = 128 bf16 on the H200 (BENCHMARKS.md 2026-12-04, second run),
    the pass's time in the forward and the backward's recomputation together: gla 581 -> 510 us, fwd+bwd
    6.047 -> 5.991 ms. Not the delta rules, where the pass also writes U = U0 - W h_c and it measured
    slower: gated_deltanet 704 -> 793 us (fwd+bwd 4.646 -> 4.731), kda 1453 -> 1462."""
    return (spec.is_linear and not spec.rule.ut_transform and spec.decay != "none"
            and not keys_in_passes(spec))


def fused_dq_dk(spec: Spec) -> bool:
    """Whether the backward's step 4 runs as one kernel (chunked_bwd_dqk_kernel) rather than its dq and dk
    steps apart: the two sides read the same chunk's h_c, dS, U, dO, queries and keys, which one program
    loads once (and keeps the decay gradient's query and chunk terms in registers). Both rules with no, a
    constant (the additive rule's: the delta rule's has no chunked backward) or a scalar decay, with or
    without the sum normalizer (its columns start both sides' accumulators), without stored features (the
    cases measured), bf16 B4 T8192 H16 K = V = 128 on the H100: step 4 1433 -> 1091 us for gated_deltanet
    and 889 -> 796 for deltanet at four warps and 64 value lanes, then 979 us for gated_deltanet with its
    raw tiles loaded before its value loop (BENCHMARKS.md 2026-12-06, fourth run); at eight warps, mamba2
    466 + 425 -> 698 us (fwd+bwd 2.034 -> 1.843 ms), linear_transformer 481 + 500 -> 810 (3.806 -> 3.619),
    retnet 269 + 273 -> 551 (its dq step reads no dS: the same time; 2026-12-07, twelfth run). Not vector
    decay, whose pair sums by blocks hold more registers on each side: gla 1046 + 1426 -> 3206 us at four
    warps, kda 1419 + 1608 -> 3017 at its best width (2026-12-07, thirteenth run); nor FAVOR+ with its stored
    features (performer)."""
    return (spec.is_linear and spec.mask != "bidirectional" and spec.decay in ("none", "scalar", "constant")
            and not (spec.rule.ut_transform and spec.decay == "constant")
            and not stored_grad_features(spec))


def stored_grad_features(spec: Spec) -> bool:
    """Whether the backward's dq and dk steps read the stored features as well (stored_features), projecting
    only for the feature map's gradient: not with the l2 norm, whose gradient takes the features before it."""
    return stored_features(spec) and spec.qk_norm == "none"


# The identity feature map's Triton source and its derivative's (algebra.triton_source of x and of 1).
IDENTITY_SOURCE, IDENTITY_GRAD_SOURCE = "x", "1.0"


def kernel_spec(spec: Spec) -> KernelSpec:
    if spec.is_linear and spec.feature_map == "identity":
        # the identity map's fragments as algebra prints them (tests/test_algebra.py): a spec without a
        # feature map renders with no sympy imported (a second of a fresh process's attngen.load)
        phi, phi_grad, feature = IDENTITY_SOURCE, IDENTITY_GRAD_SOURCE, "identity"
    elif spec.is_linear and spec.feature_map != "favor_plus":
        from . import algebra  # sympy only for the feature maps it prints

        expr = algebra.feature_expr(spec.feature_map, spec.feature_expr)
        phi, phi_grad = algebra.triton_source(expr), algebra.triton_source(algebra.derivative(expr))
        feature = "identity" if spec.feature_map == "identity" else "elementwise"
    else:
        phi = phi_grad = "x"
        feature = "favor_plus" if spec.is_linear else "identity"
    family = launch_family(spec)
    forward, backward = chunked_steps(spec)
    return KernelSpec(
        name=spec.name, spec_hash=spec.hash, spec_dict=repr(spec.to_dict()), semantics=spec.describe(),
        attention=spec.attention,
        forms=tuple(f.name for f in plan(spec).forms), feature=feature, phi=phi, phi_grad=phi_grad,
        qk_norm=spec.qk_norm == "l2", update=spec.update, decay=spec.decay,
        normalize=spec.normalize == "sum", mask=spec.mask, window=spec.window or 0,
        l2_eps=L2_EPS, norm_eps=NORM_EPS, decay_span=DECAY_SPAN, decay_span_gamma=f"{math.exp(-DECAY_SPAN):.9g}",
        ut_inverse=ut_inverse(spec), chunked_fwd_steps=step_names(forward, "chunked_"),
        chunked_bwd_steps=step_names(backward, "chunked_bwd_"), stored_features=stored_features(spec),
        stored_grad_features=stored_grad_features(spec), keys_in_passes=keys_in_passes(spec),
        output_in_states=output_in_states(spec),
        states_decay_ahead=states_decay_ahead(spec), dv_after_states=dv_after_states(spec),
        rule_hook=hooks.rule_hook(spec.update) if spec.is_linear else None, decay_hook=hooks.decay_hook(spec.decay),
        feature_hook=hooks.feature_hook(feature),
        mask_hook=None if spec.is_linear else hooks.mask_hook(spec.mask, spec.window or 0),
        bias_hook=None if spec.is_linear else hooks.bias_hook(spec.decay),
        launch_knobs=tuple((p, LAUNCHES[family].knobs(p)) for p in ("fwd", "bwd")) if family else ())


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


def chunked_steps(spec: Spec) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """The chunked kernels of a causal linear spec in launch order, (forward, backward), each step
    (kernel, what it does); ((), ()) where the spec has no chunked kernels. The backward recomputes
    the forward's first two steps at its own chunk."""
    if not spec.is_linear or spec.mask == "bidirectional":
        return (), ()
    delta, norm = spec.rule.ut_transform, spec.normalize == "sum"
    ut = f"chunk-parallel: (I + A)^-1 by 16-token blocks (the diagonal ones by {ut_inverse(spec)}); W, U0, the decayed " \
         "keys too where the launch's wu_warps is 0"
    wu = "chunk-parallel, where the launch's wu_warps > 0{}: W, U0, the decayed keys from the stored (I + A)^-1, at those warps"
    keys = (("chunked_keys_kernel", "chunk-parallel: the featurized keys decayed to the chunk's end"),)
    in_passes = keys_in_passes(spec)
    prepare = (("chunked_ut_kernel", ut), ("chunked_wu_kernel", wu.format(""))) if delta else () if in_passes else keys
    # a long sequence by segments (kernel_lib.chunked_state_segments): a first launch of each segment's end
    # from zeros, then the states from them (the delta rule's segments start where kernel_lib's
    # chunked_segment_starts_kernel walked their [F, F] transitions between the two)
    segments = (", by segments where the launch asks or its programs leave SMs idle (a launch of their end states and "
                + ("[F, F] transitions, kernel_lib's walk over them" if delta else "decays") + ", then the states)")
    states = ("chunked_states_kernel", "sequential over chunks: the chunk-start states"
              + (", the written values U = U0 - W S" if delta else "")
              + (" (each chunk's keys from k, its decays from g, in its loop)" if in_passes else "") + segments)
    fwd_states = (states[0], states[1] + ("; where the launch's output_in_states is 1, the outputs O = (Q ⊙ Γ) S_c + P U "
                                          "from each chunk's start state in registers, no states stored and no output pass"
                                          if output_in_states(spec) else ""))
    stored = " (the keys' features as the keys step stored them)" if stored_features(spec) else ""
    # vector decay's output pass: the chunks within DECAY_SPAN, then the others by blocks in a kernel of their own
    vector = spec.decay == "vector"
    in_span = f", the chunks whose decay spans at most {DECAY_SPAN:g}" if vector else ""
    blocks = (("chunked_output_blocks_kernel", "chunk-parallel: the other chunks, by 16-token blocks"),) if vector else ()
    output = ("chunked_output_kernel", "chunk-parallel: (Q ⊙ Γ) S + P U" + stored
              + (in_span + " in every feature (P one dot)" if vector else ""))
    forward = (*prepare, fwd_states, output, *blocks)
    if delta and spec.decay == "constant":
        return forward, ()  # its gradients come from the PyTorch chunked form
    if delta:
        # a differentiated forward keeps (I + A)^-1 where the backward's chunk divides its own: its
        # diagonal blocks are the backward chunks' inverses (the template's chunked_keeps_inverse)
        prepare = (("chunked_ut_kernel", ut + "; not where the forward kept (I + A)^-1 (the backward's chunk divides "
                    "the forward's)"),
                   ("chunked_wu_kernel", wu.format(", or at bwd_wu_warps from the forward's (I + A)^-1 where it kept it")))
        # and the states entering its segments where the backward's end at the same tokens (chunked_keeps_starts)
        states = (states[0], states[1] + "; from the states entering the segments that the forward's walk left, where "
                  "its segments end at the same tokens (no first launch or walk of its own)")
    backward = (*prepare, states)
    if norm:
        backward += (("chunked_output_kernel", "chunk-parallel: the normalizer n and c = -do.õ / n² per token" + stored
                      + (", the queries' features for the steps after it" if stored else "") + in_span), *blocks)
    if dv_after_states(spec):
        backward += (("chunked_bwd_states_kernel", "sequential over chunks at bwd_warps, one dot per chunk: dS per chunk "
                      "(each chunk's queries from q, its decays from g, in its loop)" + segments),
                     ("chunked_bwd_dv_kernel", "chunk-parallel, at the launch's bwd_warps: dv = P^T dO + K̂r dS"))
    else:
        backward += (("chunked_bwd_du_local_kernel", "chunk-parallel, at the launch's bwd_warps: dU = P^T dO inside the chunk, "
                      "Q ⊙ Γ" + (", (Q ⊙ Γ)^T c" if norm else "") + (" (from the stored features of the keys and queries)"
                                                                   if stored else "")),
                     ("chunked_bwd_states_kernel", "sequential over chunks at bwd_warps, one dot on the critical path: dS per chunk"
                      + (", dU += K̂r dS" if delta else ", dv = dU + K̂r dS")
                      + (", the normalizer column's dz" if norm else "")
                      + (" (each chunk's keys from k, its decays from g, in its loop)" if in_passes else "") + segments))
    decayed = spec.decay != "none"
    step4 = " (the features as stored: only the feature map's gradient projects)" if stored_grad_features(spec) else ""
    if fused_dq_dk(spec):
        backward += (("chunked_bwd_dqk_kernel", "chunk-parallel, at bwd_dq_warps: dO h_c^T and dP = dO U^T -> dq, "
                      "U dS^T and dP^T = U dO^T -> dk" + (" share" if delta else "") + (", the decay gradient" if decayed else "")
                      + (", dW = -dU h_c^T for the UT step" if delta else "")
                      + " (one load of h_c, dS, " + ("U" if delta else "V") + " and dO)"),)
    else:
        backward += (("chunked_bwd_dq_kernel", "chunk-parallel, at bwd_dq_warps: dO h_c^T and dP = dO U^T -> dq"
                      + (", the decay gradient's query terms and its chunk term sum_v h_c ⊙ dS"
                         + ("" if delta else " (where g requires grad)") if decayed else "")
                      + (", dW = -dU h_c^T for the UT step" if delta else "") + step4),)
        backward += (("chunked_bwd_dk_kernel", "chunk-parallel, at bwd_dk_warps: U dS^T and dP^T = U dO^T -> dk"
                      + (" share" if delta else "")
                      + ((", the decay gradient" + ("" if delta else " (where g requires grad)")) if decayed else "") + step4),)
    if delta:
        backward += (("chunked_bwd_wy_kernel", "chunk-parallel, at the launch's bwd_wy_warps: the UT transform's "
                      "backward -> dk, dv, dβ" + (", the decay gradient" if decayed else "")),)
    return forward, backward


def bidirectional_steps(spec: Spec) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """The bidirectional linear kernels in launch order, (forward, backward), each step (kernel, what it
    does), as templates/linear_bidirectional.py.jinja launches them; ((), ()) for other specs."""
    if not spec.is_linear or spec.mask != "bidirectional":
        return (), ()
    norm = spec.normalize == "sum"
    parts = "parallel over parts of each sequence (kernel_lib.bidirectional_blocks), the parts' float32 states added in order"
    forward = (("bidirectional_state_kernel", f"{parts}: S = Σ k̂ v^T" + (", z = Σ k̂" if norm else "")),
               ("bidirectional_output_kernel", "parallel over spans of tokens: o = q̂ S" + (" / (q̂ z + eps)" if norm else "")))
    backward = (("bidirectional_rows_grad_kernel", "parallel over spans of tokens, for q: dq̂ = S dO"
                 + (" / d - z (q̂·S dO) / d^2, and each token's weights 1 / d and -(dO·o) / d" if norm else "")
                 + ", through the feature map's chain rule"),
                ("bidirectional_state_kernel", f"{parts}: dS = Σ q̂ dO^T"
                 + (" / d, dz = -Σ q̂ (dO·o) / d, from the tokens' weights" if norm else "")),
                ("bidirectional_output_kernel", "parallel over spans of tokens: dv = k̂ dS"),
                ("bidirectional_rows_grad_kernel", "parallel over spans of tokens, for k: dk̂ = dS v"
                 + (" + dz" if norm else "") + ", through the feature map's chain rule"))
    return forward, backward


def step_names(steps: tuple[tuple[str, str], ...], prefix: str) -> tuple[str, ...]:
    """The step templates' names of chunked_steps' kernels named prefix...: chunked_bwd_dq_kernel -> dq
    (prefix chunked_bwd_: the backward's own steps, not the forward's it recomputes)."""
    return tuple(kernel.removeprefix(prefix).removesuffix("_kernel") for kernel, _ in steps if kernel.startswith(prefix))


def explain(plan_: Plan) -> str:
    """The plan as text: semantics, then each form's stages, the chunked kernels' steps."""
    lines = [f"{plan_.spec.name}: {plan_.spec.describe()}", f"legal forms: {', '.join(f.name for f in plan_.forms)}"]
    for form in plan_.forms:
        lines.append(f"\nform {form.name}: {form.doc}")
        for i, stage in enumerate(form.stages, 1):
            lines.append(f"  {i:2d}. {stage.signature():<70s} # {stage.doc}")
    kind = "bidirectional" if plan_.spec.mask == "bidirectional" else "chunked"
    forward, backward = (bidirectional_steps if kind == "bidirectional" else chunked_steps)(plan_.spec)
    for name, steps in (("forward", forward), ("backward", backward)):
        if steps:
            lines.append(f"\n{kind} kernels, {name}, in launch order:")
            lines += [f"  {i:2d}. {kernel:<32s} # {doc}" for i, (kernel, doc) in enumerate(steps, 1)]
    lines.append("\n" + MEMORY[_memory_key(plan_.spec)])
    return "\n".join(lines)


# What a training step keeps beyond the inputs and outputs, per form of the kernels.
MEMORY = {
    "softmax": "training memory (kernels): the forward saves o and the log-sum-exp (O(T) per head); "
               "the backward recomputes the scores tile by tile",
    "bidirectional": "training memory (kernels): the forward saves o and its state (F x V per sequence and head, "
                     "float32); the backward's steps keep the state gradient (as many values), with the sum normalizer "
                     "two float32 weights per token (1 / d and -(dO·o) / d), and the parts of both states while they "
                     "are summed",
    "causal": "training memory (kernels): the forward saves o and the final state; the chunked forward "
              "keeps, only during the call, the chunk-start states (T/C x F x V per head: bf16 for bf16 inputs, "
              "float32 with vector decay or other inputs; the sum normalizer's column T/C x F float32) and the decayed keys (T x F values, "
              "none where the state passes read k: keys_in_passes; bf16 for bf16 inputs, else float32; "
              "with the delta rule also W and the written values, T x (F + V), "
              "and the UT transform's (I + A)^-1, T x C, bf16 for bf16 inputs, else float32); the recurrent backward keeps per-token "
              "partials, O(T (K + V)) per head times the value blocks; the chunked backward recomputes the "
              "chunk-start states at the launch's backward chunk C' (bwd_chunk; T/C' x F x V per head: bf16 for "
              "bf16 inputs, else float32; the sum normalizer's column T/C' x F float32) and keeps the "
              "state gradient per chunk (as many values, of the same dtype) and per-token pieces (dU, the decayed "
              "queries: T x (F + V), none where the state-gradient pass reads q: dv_after_states; with the "
              "delta rule a dk and decay-gradient part for its UT step, T x F float32, and its dA, T x C' "
              "float32; with the normalizer n, c and dO / n), transient inside the backward, each released "
              "after the last step that reads it (the peak of a training step: python bench/peak_memory.py SPEC)",
}


def _memory_key(spec: Spec) -> str:
    if not spec.is_linear:
        return "softmax"
    return "bidirectional" if spec.mask == "bidirectional" else "causal"
