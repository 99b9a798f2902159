"""The arguments of the ops, described once.

Each op a generated module registers (the kernel op, its serving call on a cache, its backward)
and the runtime contract (torch.ops.attngen.<name>, the module's `attention`) takes arguments
whose names, order, schema types and defaults are listed here. The templates render their def
lines, calls and torch.library schemas from these lists (codegen puts them in the template's
context as `sig`); the runtime binds its calls of the generated ops by name through them.
"""
from __future__ import annotations

import dataclasses

# torch.library schema type -> the annotation torch.library.custom_op reads it from
_ANNOTATIONS = {
    "Tensor": "torch.Tensor", "Tensor?": "Optional[torch.Tensor]", "float": "float", "float?": "Optional[float]",
    "str": "str", "bool": "bool", "SymInt": "int", "SymInt?": "Optional[int]", "SymInt[]": "list[int]",
}

# generated code's line length (ruff's, pyproject.toml)
WIDTH = 120


@dataclasses.dataclass(frozen=True)
class Arg:
    """One argument: its name, schema type (a key of _ANNOTATIONS), default as Python source
    (None: none), whether it is keyword-only, and what it holds."""

    name: str
    kind: str
    doc: str
    default: str | None = None
    keyword: bool = False

    def __post_init__(self):
        if self.kind not in _ANNOTATIONS:
            raise ValueError(f"kind: {self.kind!r} of argument {self.name!r} is not allowed; allowed: "
                             f"{', '.join(_ANNOTATIONS)}")

    def param(self) -> str:
        """`name` or `name=default`, as in a def line."""
        return self.name if self.default is None else f"{self.name}={self.default}"

    def annotated(self) -> str:
        """`name: annotation` or `name: annotation = default`, as in a custom op's def line."""
        text = f"{self.name}: {_ANNOTATIONS[self.kind]}"
        return text if self.default is None else f"{text} = {self.default}"

    def schema(self) -> str:
        text = f"{self.kind} {self.name}"
        return text if self.default is None else f"{text}={self.default}"


@dataclasses.dataclass(frozen=True)
class OpSignature:
    """The arguments of one op, in order."""

    args: tuple[Arg, ...]
    names: tuple[str, ...] = dataclasses.field(init=False, repr=False, compare=False)
    name_set: frozenset[str] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # derived once, not per call: bind runs on every call of an op (and torch.compile traces
        # it, so no functools.cached_property, whose lock it cannot enter)
        object.__setattr__(self, "names", tuple(a.name for a in self.args))
        object.__setattr__(self, "name_set", frozenset(self.names))

    def __add__(self, other: OpSignature) -> OpSignature:
        return OpSignature(self.args + other.args)

    def without(self, *names: str) -> OpSignature:
        _known(self, names)
        return OpSignature(tuple(a for a in self.args if a.name not in names))

    def replace(self, *args: Arg) -> OpSignature:
        """These arguments in place of those of their names."""
        by_name = {a.name: a for a in args}
        _known(self, by_name)
        return OpSignature(tuple(by_name.get(a.name, a) for a in self.args))

    def call(self, **exprs: str) -> list[str]:
        """The arguments of a call passing each by its name, or by the expression given for it."""
        _known(self, exprs)
        return [exprs.get(n, n) for n in self.names]

    def keywords(self, positional: int) -> list[str]:
        """A call's arguments: the first `positional` by position, the others as name=name."""
        return [n if i < positional else f"{n}={n}" for i, n in enumerate(self.names)]

    def params(self) -> list[str]:
        """The def line's parameters, `*` before the keyword-only ones."""
        return self._starred([a.param() for a in self.args])

    def _starred(self, items: list[str]) -> list[str]:
        """items (one per argument) with `*` before the first keyword-only one."""
        first = next((i for i, a in enumerate(self.args) if a.keyword), len(items))
        return items[:first] + (["*"] if first < len(items) else []) + items[first:]

    def quoted(self) -> list[str]:
        """The names as string literals."""
        return [f'"{n}"' for n in self.names]

    def annotated(self) -> list[str]:
        return [a.annotated() for a in self.args]

    def schema(self, name: str, returns: str) -> str:
        """The torch.library schema `name(Tensor q, ...) -> returns`."""
        return f"{name}({', '.join(self._starred([a.schema() for a in self.args]))}) -> {returns}"

    def bind(self, **values) -> tuple:
        """The values in this signature's order (every argument given, by name, and no other)."""
        names = self.names
        if values.keys() != self.name_set:
            missing = [n for n in names if n not in values]
            extra = [n for n in values if n not in names]
            raise ValueError(f"values: expected exactly the arguments {', '.join(self.names)}; missing "
                             f"{missing or 'none'}, not arguments {extra or 'none'}")
        return tuple([values[n] for n in names])

    def named(self, values) -> dict:
        """A sequence of values in this signature's order (or a prefix of it) by name."""
        if len(values) > len(self.args):
            raise ValueError(f"values: expected at most {len(self.args)} ({', '.join(self.names)}), got {len(values)}")
        return dict(zip(self.names, values))


def _known(sig: OpSignature, names) -> None:
    unknown = [n for n in names if n not in sig.names]
    if unknown:
        raise ValueError(f"names: {unknown} are not arguments; allowed: {', '.join(sig.names)}")


def wrap(head: str, items, tail: str, width: int = WIDTH) -> str:
    """`head` + items joined by ", " + `tail`, greedily filled to `width` columns, continuation lines
    aligned after `head` (whose leading spaces are the line's indent): a def line or a call."""
    items = list(items)
    indent = " " * len(head)
    lines, line = [], head
    for i, item in enumerate(items):
        piece = item + (", " if i < len(items) - 1 else tail)
        if line.strip() and line != head and len(line) + len(piece.rstrip()) > width:
            lines.append(line.rstrip())
            line = indent
        line += piece
    lines.append(line)
    return "\n".join(lines)


def string(head: str, text: str, width: int = WIDTH) -> str:
    """`head` + text (a schema) as a parenthesized Python string literal, cut after ", " into adjacent literals
    to fit `width` columns; the pieces holding {placeholders} are f-strings."""
    pieces, piece = [], ""
    indent = len(head) + 1
    # cut between arguments, not inside a schema's return type
    call, arrow, returns = text.partition(" -> ")
    parts = call.split(", ")
    parts[-1] += arrow + returns
    for i, part in enumerate(parts):
        word = part + (", " if i < len(parts) - 1 else "")
        # each piece is quoted (2 columns) and perhaps f-prefixed (1), and the last closes the parenthesis
        if piece and indent + len(piece) + len(word) + 4 > width:
            pieces.append(piece)
            piece = ""
        piece += word
    pieces.append(piece)
    literal = lambda p: ("f" if "{" in p else "") + '"' + p + '"'
    return head + "(" + ("\n" + " " * indent).join(literal(p) for p in pieces) + ")"


def block(items, indent: int = 4, width: int = WIDTH) -> str:
    """Items one after the other, each followed by a comma, in lines of `indent` spaces filled to
    `width` columns: the arguments of a def whose parentheses stand on lines of their own."""
    lines, line = [], ""
    for item in items:
        piece = f"{item}, "
        if line and indent + len(line) + len(piece.rstrip()) > width:
            lines.append(" " * indent + line.rstrip())
            line = ""
        line += piece
    lines.append(" " * indent + line.rstrip())
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the arguments

Q = Arg("q", "Tensor", "queries [B, T, H, K]")
K = Arg("k", "Tensor", "keys [B, T, H, K] (softmax: [B, Tk, H_kv, K])")
V = Arg("v", "Tensor", "values [B, T, H, V] (softmax: [B, Tk, H_kv, V])")
G = Arg("g", "Tensor?", "log decay: [B, T, H] scalar, [B, T, H, K] vector, [H] constant; None without decay")
BETA = Arg("beta", "Tensor?", "the delta rule's step [B, T, H]; None for the additive rule")
OMEGA = Arg("omega", "Tensor?", "FAVOR+ random features [F, K] float32; None for other feature maps")
INITIAL_STATE = Arg("initial_state", "Tensor?", "state [N, H, F, VS] each sequence starts from; None: zero")
CU_SEQLENS = Arg("cu_seqlens", "Tensor?", "packed sequences' offsets [N + 1] (B = 1); None: one per batch row")
SCALE = Arg("scale", "float", "the query scale")
FORM = Arg("form", "str", "the kernel form: recurrent, chunked or bidirectional")
LAUNCH = Arg("launch", "SymInt[]", "the form's launch knobs (planner.Launch.ints); [] for none")
OUTPUT_FINAL_STATE = Arg("output_final_state", "bool", "whether the final state is returned")
FOR_BACKWARD = Arg("for_backward", "bool", "whether the call will be differentiated: the forward then returns what its "
                   "backward reuses (`saved`, `starts`)", default="False")
SAVED = Arg("saved", "Tensor", "what the forward kept for its backward (the delta rules' rows of (I + A)^-1); empty: "
            "the backward recomputes it")
STARTS = Arg("starts", "Tensor?", "the states entering the forward's segments of each sequence [N, G - 1, H, F, V] float32, "
             "as the delta rules' walk left them; None or empty: the backward walks them again")
DO = Arg("do", "Tensor", "the gradient of a loss on the output o")
DHT = Arg("dht", "Tensor?", "the final state's gradient; None where no loss reached it")
DECAY_GRAD = Arg("decay_grad", "bool", "whether the decay's gradient is asked for (g requires grad); False: dg is None "
                 "and the additive rule's kernels skip its terms", default="True")
STATE = Arg("state", "Tensor", "a StateCache's states [S, H, F, VS], read and written in place")
SLOTS = Arg("slots", "Tensor", "the cache slot of each sequence [N]; -1: padding")
MAX_LEN = Arg("max_len", "SymInt", "the longest sequence (of the packed ones, with cu_seqlens)")
O = Arg("o", "Tensor", "the forward's output [B, Tq, H, V]")
LSE = Arg("lse", "Tensor", "the forward's log-sum-exp [B, H, Tq] ([H, T] packed)")
DLSE = Arg("dlse", "Tensor?", "the log-sum-exp's gradient; None where no loss reached it")
K_CACHE = Arg("k_cache", "Tensor", "a StateCache's keys [S, L, H_kv, K], appended to in place")
V_CACHE = Arg("v_cache", "Tensor", "a StateCache's values [S, L, H_kv, V], appended to in place")
KV_LENS = Arg("kv_lens", "Tensor", "the tokens each slot holds [S] int32, advanced in place")
KV_SLOTS = Arg("kv_slots", "Tensor", "the cache slot of each sequence [N]; -1: padding")
G_NEW = Arg("g", "Tensor", "the new positions' log decays [B, T, H] (a softmax cache with scalar decay)")
G_HI = Arg("g_hi", "Tensor", "a StateCache's cumulative log decays G [S, L, H] (log2 units), the high part of the pair")
G_LO = Arg("g_lo", "Tensor", "the low part of G's pair [S, L, H], appended to in place with g_hi")
RETURN_LSE = Arg("return_lse", "bool", "whether the log-sum-exp is returned too", keyword=True)


def _contract(arg: Arg, kind: str | None = None, default: str = "None") -> Arg:
    """The argument as the runtime contract takes it: a keyword with a default."""
    return dataclasses.replace(arg, kind=kind or arg.kind, default=default)


# The generated linear op: its tensor inputs (saved for the backward), then the call's other values.
LINEAR_INPUTS = OpSignature((Q, K, V, G, BETA, OMEGA, INITIAL_STATE, CU_SEQLENS))
LINEAR_OP = LINEAR_INPUTS + OpSignature((SCALE, FORM, LAUNCH, OUTPUT_FINAL_STATE, FOR_BACKWARD))
LINEAR_CACHED = OpSignature((Q, K, V, G, BETA, OMEGA, STATE, SLOTS, CU_SEQLENS, SCALE, FORM, LAUNCH))
LINEAR_BACKWARD = LINEAR_OP.without("output_final_state", "for_backward") + OpSignature((SAVED, STARTS, DO, DHT, DECAY_GRAD))
LINEAR_CONTRACT = OpSignature((
    Q, K, V, _contract(G), _contract(BETA), _contract(SCALE, "float?"), _contract(INITIAL_STATE),
    _contract(OUTPUT_FINAL_STATE, default="False"), _contract(CU_SEQLENS)))

# The generated softmax op, likewise.
SOFTMAX_INPUTS = OpSignature((Q, K, V, G, CU_SEQLENS))
SOFTMAX_OP = SOFTMAX_INPUTS + OpSignature((SCALE, MAX_LEN, LAUNCH))
SOFTMAX_CACHED = OpSignature((Q, K, V, K_CACHE, V_CACHE, KV_LENS, KV_SLOTS, CU_SEQLENS, SCALE, MAX_LEN, LAUNCH))
# with scalar decay (forgetting attention) the serving call also takes the new positions' log decays and
# the cache's G pairs, which it appends to as it does to the keys
SOFTMAX_CACHED_DECAY = OpSignature((Q, K, V, G_NEW, K_CACHE, V_CACHE, G_HI, G_LO, KV_LENS, KV_SLOTS, CU_SEQLENS, SCALE,
                                    MAX_LEN, LAUNCH))
# the backward reads max_len from cu_seqlens where it is None
SOFTMAX_BACKWARD = (SOFTMAX_OP.replace(dataclasses.replace(MAX_LEN, kind="SymInt?"))
                    + OpSignature((O, LSE, DO, DLSE)))
SOFTMAX_CONTRACT = OpSignature((Q, K, V, _contract(G), _contract(SCALE, "float?"), _contract(CU_SEQLENS)))
SOFTMAX_CONTRACT_LSE = SOFTMAX_CONTRACT + OpSignature((RETURN_LSE,))


@dataclasses.dataclass(frozen=True)
class Signatures:
    """The signatures of one attention family's ops, as the templates read them."""

    inputs: OpSignature         # the op's tensor inputs, saved for its backward
    op: OpSignature             # the kernel op
    cached: OpSignature         # its serving call on a StateCache
    backward: OpSignature       # the backward op
    contract: OpSignature       # the runtime contract (torch.ops.attngen.<name>)
    contract_lse: OpSignature | None   # softmax: the contract's overload with return_lse


LINEAR = Signatures(LINEAR_INPUTS, LINEAR_OP, LINEAR_CACHED, LINEAR_BACKWARD, LINEAR_CONTRACT, None)
SOFTMAX = Signatures(SOFTMAX_INPUTS, SOFTMAX_OP, SOFTMAX_CACHED, SOFTMAX_BACKWARD, SOFTMAX_CONTRACT,
                     SOFTMAX_CONTRACT_LSE)
SOFTMAX_DECAY = dataclasses.replace(SOFTMAX, cached=SOFTMAX_CACHED_DECAY)


def softmax_cached(decay: str) -> OpSignature:
    """The serving call's signature of a softmax op with decay: none | scalar."""
    if decay not in ("none", "scalar"):
        raise ValueError(f"decay: {decay!r} is not allowed for softmax; allowed: none, scalar")
    return SOFTMAX_CACHED_DECAY if decay == "scalar" else SOFTMAX_CACHED


def signatures(attention: str, decay: str = "none") -> Signatures:
    """The ops' signatures of attention: linear | softmax, with decay (softmax: none | scalar; the
    serving call of scalar decay takes the log decays too)."""
    if attention not in ("linear", "softmax"):
        raise ValueError(f"attention: {attention!r} is not allowed; allowed: linear, softmax")
    if attention == "linear":
        return LINEAR
    return SOFTMAX_DECAY if softmax_cached(decay) is SOFTMAX_CACHED_DECAY else SOFTMAX
