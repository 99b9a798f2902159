"""Spec loading: YAML (or a dict) -> a frozen, validated `Spec`.

The field list, types, allowed values and defaults come from schema.yaml beside this file;
the rules that tie fields together live here. Every problem becomes one `SpecError`
naming the file, the line, the field, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import yaml

# Constants of the semantics (DESIGN.md §3), shared by the interpreter, the forms and the kernels.
L2_EPS = 1e-6     # l2 norm: x / sqrt(sum(x^2) + L2_EPS)
NORM_EPS = 1e-6   # normalize sum: o / (z.q + NORM_EPS)
# log decays below this enter at it: exp is exactly 0 below about -745 in float64 (-104 in
# float32), so a reset (g = -inf) gives the same results, and cumulative sums stay finite
LOG_DECAY_FLOOR = -1e4
# The floor of log decays the chunked kernels sum in float32 (their cumulative log decays for 16-bit
# inputs: kernel_lib.chunked_decay_dtype). Below about -104, exp underflows to 0 in float32, where
# the kernels take every exp, so it leaves results as LOG_DECAY_FLOOR does; at -1e4, a chunk of
# resets would sum to -6.4e5, whose float32 spacing (0.06) would put 6% errors into the pair factors
# exp(G_t - G_s) of its later tokens; at -200 the sums stay within 64 x 200 = 12800, spacing 2^-10.
LOG_DECAY_FLOOR32 = -200.0
# Chunk sizes of the chunked kernels (their UT transform works in 16-token blocks): the planner
# chooses among them, the generated launchers check them (kernel_lib.chunked_check_chunk).
KERNEL_CHUNKS = (16, 32, 64)
# The largest scale: float32's largest finite value (the kernels, and the PyTorch forms of 16-bit and
# float32 inputs, scale in float32, where a larger one is inf and the outputs NaN).
SCALE_MAX = 3.4028234663852886e38

SCHEMA_PATH = Path(__file__).with_name("schema.yaml")
_NAME_RE = re.compile(r"[a-z][a-z0-9_]*\Z")


class SpecError(ValueError):
    """A spec is malformed or illegal. The message names file, line, field, value, allowed."""

    def __init__(self, source: str, line: int | None, field: str | None, message: str):
        self.source, self.line, self.field = source, line, field
        where = source if line is None else f"{source}:{line}"
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}: {what}{message}")


@dataclasses.dataclass(frozen=True)
class Rule:
    """What attngen knows of a linear update rule outside its kernels (whose fragments are the rule's
    hook, hooks.rule_hook) and its math (the oracle's linear_step, the PyTorch forms' token_scan and
    ut_transform): its formula, its inputs, its cost and where it is legal. A rule of RULES, by name."""

    formula: str            # the update in one line (Spec.describe)
    takes_beta: bool        # a per-token write strength beta [B, T, HV] is an input of the op
    state_flops: float      # the forward's FLOPs per state element and token (a product written, one read; the
                            # delta rule's prediction S^T k too): the benchmark's TFLOP/s
    ut_transform: bool      # the transition depends on the keys (S <- (I - beta k k^T) D(S) + ...): each chunk
                            # lowered by the UT transform (W, U), its kernels and their launch knobs
    bidirectional: bool     # legal with mask: bidirectional (its state a plain sum of the pieces' K^T V)
    sum_normalizer: bool    # legal with normalize: sum (the normalizer a column of ones the rule writes)


RULES = {
    "additive": Rule("S = D(S) + k v^T", takes_beta=False, state_flops=4.0, ut_transform=False,
                     bidirectional=True, sum_normalizer=True),
    "delta": Rule("S = D(S) + beta k (v - D(S)^T k)^T", takes_beta=True, state_flops=6.0, ut_transform=True,
                  bidirectional=False, sum_normalizer=False),
}


@dataclasses.dataclass(frozen=True)
class FavorPlus:
    features: int = 64
    orthogonal: bool = True
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Spec:
    """A validated attention spec (DESIGN.md §1). Defaults are filled in."""

    name: str
    attention: str                      # linear | softmax
    feature_map: str = "identity"       # identity | elu_plus_one | relu | favor_plus | expr
    feature_expr: str | None = None     # the sympy expression when feature_map == "expr"
    favor_plus: FavorPlus | None = None
    qk_norm: str = "none"
    update: str = "additive"
    decay: str = "none"
    normalize: str = "none"
    mask: str = "causal"
    window: int | None = None
    scale: float | None = None          # None: auto
    source: str = dataclasses.field(default="<dict>", compare=False)

    @property
    def is_linear(self) -> bool:
        return self.attention == "linear"

    @property
    def rule(self) -> Rule:
        """The update rule's facts (RULES; a softmax spec's update is additive)."""
        return RULES[self.update]

    def feature_dim(self, head_dim: int) -> int:
        """F, the state's row count: K, or the FAVOR+ feature count."""
        return self.favor_plus.features if self.feature_map == "favor_plus" else head_dim

    def default_scale(self, head_dim: int) -> float:
        if self.scale is not None:
            return self.scale
        return 1.0 if self.feature_map == "favor_plus" else head_dim ** -0.5

    def to_dict(self) -> dict[str, Any]:
        """The canonical dict form: loading it gives back an equal Spec."""
        d: dict[str, Any] = {"name": self.name, "attention": self.attention}
        if self.is_linear:
            d["feature_map"] = {"expr": self.feature_expr} if self.feature_map == "expr" else self.feature_map
            if self.favor_plus is not None:
                d["favor_plus"] = dataclasses.asdict(self.favor_plus)
            d.update(qk_norm=self.qk_norm, update=self.update)
        d["decay"] = self.decay
        if self.is_linear:
            d["normalize"] = self.normalize
        d["mask"] = self.mask
        if self.window is not None:
            d["window"] = self.window
        d["scale"] = "auto" if self.scale is None else self.scale
        return d

    @property
    def hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def describe(self) -> str:
        """The semantics in one line."""
        if not self.is_linear:
            bias = " + cumulative log-decay bias" if self.decay == "scalar" else ""
            win = f" (window {self.window})" if self.mask == "sliding_window" else ""
            return f"softmax attention, {self.mask}{win}{bias}"
        fm = f"expr {self.feature_expr!r}" if self.feature_map == "expr" else self.feature_map
        rule = self.rule.formula
        parts = [f"linear attention, phi = {fm}"]
        if self.qk_norm == "l2":
            parts.append("l2-normalised q,k")
        parts.append(f"{rule}, decay {self.decay}")
        if self.normalize == "sum":
            parts.append("sum-normalised output")
        parts.append(self.mask)
        return "; ".join(parts)


@lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    with open(SCHEMA_PATH) as f:
        return yaml.safe_load(f)


# --------------------------------------------------------------------------- YAML with lines

class _Located:
    """Maps a field path to its line in the YAML source (1-based), when known."""

    def __init__(self, source: str, lines: dict[str, int] | None = None):
        self.source, self.lines = source, lines or {}

    def error(self, field: str | None, message: str, at: str | None = None) -> SpecError:
        """`at`: the field whose line to show when `field` itself is not in the file."""
        line = self.lines.get(field) if field else None
        if line is None and at:
            line = self.lines.get(at)
        if line is None and field and "." in field:
            line = self.lines.get(field.split(".")[0])
        return SpecError(self.source, line, field, message)


def _compose(text: str, source: str) -> tuple[dict[str, Any], _Located]:
    """Parse YAML, keeping each key's line and rejecting duplicate keys."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise _yaml_error(e, source) from None
    if node is None:
        raise SpecError(source, None, None,
                        "the spec is empty; expected a mapping with at least 'name' and 'attention'")
    if not isinstance(node, yaml.MappingNode):
        raise SpecError(source, node.start_mark.line + 1, None,
                        "the spec must be a mapping of fields (name: ..., attention: ...)")
    # Aliases share nodes, so a few anchors can expand to billions of nodes (and to values whose
    # walk, repr or comparison never ends): bound the expanded size first.
    max_nodes = schema()["limits"]["yaml_nodes"]
    stack, size = [node], 0
    while stack:
        n = stack.pop()
        size += 1
        if size > max_nodes:
            raise SpecError(source, None, None, f"the spec expands to more than {max_nodes} YAML nodes "
                                                "(through aliases); a spec is a small mapping of fields")
        if isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)
        elif isinstance(n, yaml.MappingNode):
            stack.extend(item for pair in n.value for item in pair)
    lines: dict[str, int] = {}

    def walk(mapping: yaml.MappingNode, prefix: str) -> None:
        seen = set()
        for key, value in mapping.value:
            if not isinstance(key, yaml.ScalarNode):
                raise SpecError(source, key.start_mark.line + 1, None, "field names must be plain words")
            name = prefix + key.value
            if name in seen:
                raise SpecError(source, key.start_mark.line + 1, name, "is given twice")
            seen.add(name)
            lines[name] = key.start_mark.line + 1
            if isinstance(value, yaml.MappingNode):
                walk(value, name + ".")

    walk(node, "")
    try:
        data = yaml.load(text, Loader=_SafeLoader)
    except yaml.YAMLError as e:  # e.g. a tag the safe loader refuses, the date 2001-13-45
        raise _yaml_error(e, source) from None
    return data, _Located(source, lines)


class _SafeLoader(yaml.SafeLoader):
    """SafeLoader whose scalar constructors fail with a located YAMLError: PyYAML's own raise
    ValueError, KeyError, IndexError or AttributeError for e.g. `2001-13-45`, `!!bool maybe`,
    `!!int ` (empty)."""

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, KeyError, IndexError, AttributeError, TypeError, OverflowError) as e:
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read the value {node.value!r} as {node.tag.rsplit(':', 1)[-1]} ({e})",
                node.start_mark) from None


def _yaml_error(e: yaml.YAMLError, source: str) -> SpecError:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    line = mark.line + 1 if mark is not None else None
    problem = getattr(e, "problem", None) or (str(e).splitlines() or [type(e).__name__])[0]
    return SpecError(source, line, None, f"malformed YAML: {problem}")


# --------------------------------------------------------------------------- validation

def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_finite(x: float) -> bool:
    try:
        return math.isfinite(float(x))
    except OverflowError:  # an int too large for a float
        return False


def show_value(value: Any) -> str:
    """A value for an error message: its repr, cut when long, with its length."""
    text = repr(value)
    if len(text) <= 80:
        return text
    return f"{text[:60]}... ({len(value) if isinstance(value, str) else len(text)} characters)"


def _did_you_mean(value: Any, options) -> str:
    """' did you mean 'x'?' for a misspelt word close to one of `options`, else ''."""
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, [str(o) for o in options], n=1, cutoff=0.6)
    return f" did you mean {close[0]!r}?" if close else ""


def _choice(loc: _Located, data: Mapping[str, Any], field: str, allowed: list[str]) -> str:
    info = schema()["fields"][field]
    value = data.get(field, info.get("default"))
    if not isinstance(value, str) or value not in allowed:
        raise loc.error(field, f"value {show_value(value)} is not allowed;{_did_you_mean(value, allowed)} "
                               f"allowed: {', '.join(allowed)}")
    return value


def _bounded_int(loc: _Located, field: str, value: Any, info: Mapping[str, Any]) -> int:
    """An integer within the schema's [min, max] for `field`."""
    lo, hi = info["min"], info["max"]
    if not _is_int(value) or not lo <= value <= hi:
        raise loc.error(field, f"value {show_value(value)} is not allowed; allowed: an integer from {lo} to {hi}")
    return value


def _only_with(loc: _Located, data: Mapping, key: str, resolved: dict[str, Any]) -> None:
    """The schema's only_with rule of `key`: given, it needs each named field at its value
    (resolved: every field's value in this spec, defaults filled in)."""
    for other, needed in schema()["fields"][key].get("only_with", {}).items():
        if key in data and resolved[other] != needed:
            raise loc.error(key, f"value {data[key]!r} is only allowed with {other}: {needed} "
                                 f"({other} is {resolved[other]!r})")


def _validate(data: Any, loc: _Located) -> Spec:
    fields = schema()["fields"]
    if not isinstance(data, Mapping):
        raise loc.error(None, f"the spec must be a mapping of fields, got {type(data).__name__}")
    for key in data:
        if key not in fields:
            raise loc.error(str(key), f"unknown field {show_value(key)};{_did_you_mean(key, fields)} "
                                      f"allowed fields: {', '.join(fields)}")
    for key in (k for k, info in fields.items() if info.get("required")):
        if key not in data:
            raise loc.error(key, f"is required (allowed: {_allowed_text(key)})")

    name, max_len = data["name"], fields["name"]["max_length"]
    if not isinstance(name, str) or not _NAME_RE.match(name) or len(name) > max_len:
        raise loc.error("name", f"value {show_value(name)} is not allowed; allowed: a word matching "
                                f"{fields['name']['pattern']} of at most {max_len} characters")
    attention = _choice(loc, data, "attention", fields["attention"]["allowed"])
    linear = attention == "linear"

    if not linear:
        for key in (k for k, info in fields.items() if info.get("only_for") == "linear"):
            default = fields[key].get("default")
            if key in data and data[key] != default:
                raise loc.error(key, f"value {data[key]!r} is not allowed with attention: softmax; "
                                     f"this field is only for attention: linear (allowed here: omit it)")

    feature_map, feature_expr = "identity", None
    if linear:
        fm = data.get("feature_map", "identity")
        if isinstance(fm, Mapping):
            if set(fm) != {"expr"}:
                raise loc.error("feature_map", f"value {dict(fm)!r} is not allowed; a mapping here must be "
                                               "exactly {expr: \"<sympy expression in x>\"}")
            expr = fm["expr"]
            if not isinstance(expr, str):
                raise loc.error("feature_map.expr", f"value {expr!r} is not allowed; allowed: a string holding a "
                                                    "sympy expression in x, e.g. \"exp(x)\"")
            from .algebra import parse_feature_expr  # sympy is heavy; import only when used
            try:
                parse_feature_expr(expr)
            except ValueError as e:
                raise loc.error("feature_map.expr", str(e)) from None
            except RecursionError:  # parse_feature_expr bounds the nesting; never a traceback
                raise loc.error("feature_map.expr", f"value {show_value(expr)} is too deeply nested; allowed: a "
                                                    "sympy expression in x of bounded nesting") from None
            feature_map, feature_expr = "expr", expr
        else:
            allowed = [a for a in fields["feature_map"]["allowed"] if not a.startswith("{")]
            if not isinstance(fm, str) or fm not in allowed:
                raise loc.error("feature_map", f"value {show_value(fm)} is not allowed;{_did_you_mean(fm, allowed)} "
                                               f"allowed: {', '.join(allowed)}, "
                                               "or {expr: \"<sympy expression in x>\"}")
            feature_map = fm

    favor = None
    if feature_map == "favor_plus":
        raw = data.get("favor_plus")
        raw = {} if raw is None else raw
        if not isinstance(raw, Mapping):
            raise loc.error("favor_plus", f"value {raw!r} is not allowed; allowed: a mapping with "
                                          "features, orthogonal, seed")
        sub = fields["favor_plus"]["fields"]
        for key in raw:
            if key not in sub:
                raise loc.error(f"favor_plus.{key}", f"unknown field {show_value(key)};{_did_you_mean(key, sub)} "
                                                     f"allowed fields: {', '.join(sub)}")
        feats = _bounded_int(loc, "favor_plus.features", raw.get("features", sub["features"]["default"]),
                             sub["features"])
        orth = raw.get("orthogonal", sub["orthogonal"]["default"])
        if not isinstance(orth, bool):
            raise loc.error("favor_plus.orthogonal", f"value {show_value(orth)} is not allowed; allowed: true, false")
        seed = _bounded_int(loc, "favor_plus.seed", raw.get("seed", sub["seed"]["default"]), sub["seed"])
        favor = FavorPlus(feats, orth, seed)

    qk_norm = _choice(loc, data, "qk_norm", fields["qk_norm"]["allowed"]) if linear else "none"
    update = _choice(loc, data, "update", fields["update"]["allowed"]) if linear else "additive"
    normalize = _choice(loc, data, "normalize", fields["normalize"]["allowed"]) if linear else "none"
    decay = _choice(loc, data, "decay", fields["decay"]["allowed" if linear else "allowed_softmax"])
    mask = _choice(loc, data, "mask", fields["mask"]["allowed"])

    window = data.get("window")
    if mask == "sliding_window":
        if window is None:
            raise loc.error("window", f"is required with mask: sliding_window (allowed: an integer from "
                                      f"{fields['window']['min']} to {fields['window']['max']})", at="mask")
        _bounded_int(loc, "window", window, fields["window"])

    raw_scale = data.get("scale", "auto")
    if raw_scale == "auto":
        scale = None
    elif _is_number(raw_scale) and raw_scale > 0 and _is_finite(raw_scale) and float(raw_scale) <= SCALE_MAX:
        scale = float(raw_scale)
    else:
        raise loc.error("scale", f"value {raw_scale!r} is not allowed; allowed: auto, or a positive finite number "
                                 f"(at most {SCALE_MAX:.4g}, float32's largest)")

    # Rules that tie fields together: the schema's only_with, then the combinations below.
    resolved = dict(name=name, attention=attention, feature_map=feature_map, favor_plus=favor, qk_norm=qk_norm,
                    update=update, decay=decay, normalize=normalize, mask=mask, window=window, scale=raw_scale)
    for key in fields:
        _only_with(loc, data, key, resolved)
    if linear:
        if mask == "sliding_window":
            raise loc.error("mask", "value 'sliding_window' is not allowed with attention: linear; "
                                    "allowed: causal, bidirectional")
        if mask == "bidirectional" and decay != "none":
            raise loc.error("decay", f"value {decay!r} is not allowed with mask: bidirectional "
                                     "(a bidirectional linear state has no time order); allowed: none")
        if mask == "bidirectional" and not RULES[update].bidirectional:
            allowed = ", ".join(n for n, r in RULES.items() if r.bidirectional)
            raise loc.error("update", f"value {update!r} is not allowed with mask: bidirectional; allowed: {allowed}")
        if normalize == "sum" and not RULES[update].sum_normalizer:
            raise loc.error("normalize", f"value 'sum' is not allowed with update: {update}; allowed: none")
        if decay == "vector" and feature_map == "favor_plus":
            raise loc.error("decay", "value 'vector' is not allowed with feature_map: favor_plus (the decay is "
                                     "per key channel, the state is per random feature); allowed: none, "
                                     "constant, scalar")
    elif mask == "bidirectional" and decay == "scalar":
        raise loc.error("decay", "value 'scalar' is not allowed with attention: softmax and mask: bidirectional "
                                 "(the decay bias needs a time order); allowed: none")

    return Spec(name=name, attention=attention, feature_map=feature_map, feature_expr=feature_expr,
                favor_plus=favor, qk_norm=qk_norm, update=update, decay=decay, normalize=normalize,
                mask=mask, window=window if mask == "sliding_window" else None, scale=scale,
                source=loc.source)


def _allowed_text(field: str) -> str:
    info = schema()["fields"][field]
    if "allowed" in info:
        return ", ".join(info["allowed"])
    return info.get("pattern", info.get("type"))


# --------------------------------------------------------------------------- entry points

def parse_spec(text: str, source: str = "<string>") -> Spec:
    limit, size = schema()["limits"]["spec_bytes"], len(text.encode("utf-8", "surrogatepass"))
    if size > limit:  # refused before parsing: PyYAML takes minutes over tens of megabytes
        raise SpecError(source, None, None, f"the spec text is {size} bytes; a spec is at most {limit} bytes")
    try:
        data, loc = _compose(text, source)
    except RecursionError:  # PyYAML composes nested collections recursively
        raise SpecError(source, None, None, "malformed YAML: collections are nested too deeply") from None
    return _validated(data, loc)


def _validated(data: Any, loc: _Located) -> Spec:
    try:
        return _validate(data, loc)
    except RecursionError:  # e.g. a value nested too deeply to print; never a traceback
        raise SpecError(loc.source, None, None, "the spec is nested too deeply to check; a spec is a small "
                                                "mapping of fields") from None


def load_spec(spec: str | Path | Mapping[str, Any] | Spec) -> Spec:
    """A path to a YAML file, a mapping, or a Spec -> a validated Spec."""
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, Mapping):
        return _validated(dict(spec), _Located("<dict>"))
    if isinstance(spec, (str, Path)):
        path = Path(spec)
        limit = schema()["limits"]["spec_bytes"]
        try:
            # At most the limit and one byte are read: a huge file (or a device such as
            # /dev/zero, whose size says 0) is refused before parsing.
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                blob = f.read(limit + 1) if size <= limit else b""
        except OSError as e:
            raise SpecError(str(path), None, None, f"cannot read the spec file: {e.strerror}") from None
        except ValueError as e:  # e.g. a path holding a NUL byte
            raise SpecError(repr(str(path)), None, None, f"cannot read the spec file: {e}") from None
        if size > limit or len(blob) > limit:
            shown = f"{size} bytes" if size > limit else f"more than {limit} bytes"
            raise SpecError(str(path), None, None, f"the spec file is {shown}; a spec is at most {limit} bytes")
        try:
            text = blob.decode("utf-8")
        except UnicodeDecodeError:
            raise SpecError(str(path), None, None, "the spec file is not UTF-8 text") from None
        return parse_spec(text, str(path))
    raise SpecError("<argument>", None, None,
                    f"expected a path to a YAML file, a dict or a Spec, got {type(spec).__name__}")
