"""The public op: attngen.load(spec) -> an op with the runtime contract of DESIGN.md §2."""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import torch

from . import forms, planner, reference
from .inputs import Call, check_linear, check_softmax
from .spec import Spec, load_spec

BACKENDS = ("auto", "triton", "torch")


def backend() -> str:
    value = os.environ.get("ATTNGEN_BACKEND", "auto")
    if value not in BACKENDS:
        raise ValueError(f"ATTNGEN_BACKEND: value {value!r} is not allowed; allowed: {', '.join(BACKENDS)}")
    return value


class Op:
    """A compiled attention op. Linear: op(q, k, v, g, beta, scale, initial_state,
    output_final_state, cu_seqlens) -> (o, final_state); softmax: op(q, k, v, g, scale,
    cu_seqlens) -> o. `form=` and `chunk_size=` force the planner's choice."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.plan = planner.plan(spec)

    def __repr__(self) -> str:
        return f"attngen.Op({self.spec.name}: {self.spec.describe()})"

    def random_features(self, head_dim: int) -> torch.Tensor:
        """FAVOR+ Omega [features, head_dim], float64 on the CPU: a pure function of the spec's
        seed, identical in every process. ValueError for specs without feature_map: favor_plus."""
        if self.spec.feature_map != "favor_plus":
            raise ValueError(f"random_features: spec {self.spec.name!r} has feature_map "
                             f"{self.spec.feature_map!r}; only favor_plus has random features")
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim: expected a positive integer, got {head_dim!r}")
        return reference.random_features(self.spec, head_dim)

    def choose(self, call: Call, form: str | None = None, chunk_size: int | None = None) -> planner.Choice:
        return planner.choose(self.plan, call, form, chunk_size)

    def __call__(self, q, k, v, g=None, beta=None, scale=None, initial_state=None,
                 output_final_state=False, cu_seqlens=None, *, form: str | None = None,
                 chunk_size: int | None = None):
        if self.spec.is_linear:
            call = check_linear(self.spec, q, k, v, g, beta, scale, initial_state, cu_seqlens)
        else:
            if beta is not None or initial_state is not None or output_final_state:
                raise ValueError("beta, initial_state, output_final_state: softmax attention takes none of "
                                 "these (they are for attention: linear)")
            call = check_softmax(self.spec, q, k, v, g, scale, cu_seqlens)
        if backend() == "triton":
            raise ValueError("ATTNGEN_BACKEND=triton: no generated Triton kernels are available for "
                             f"{self.spec.name!r} in this build; use auto or torch")
        choice = self.choose(call, form, chunk_size)
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        ctx = forms.Ctx(self.spec, call, choice.chunk, dtype, q.device,
                        reference.random_features(self.spec, call.head_dim, q.device, dtype))
        env = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
        out = planner.execute(self.plan.form(choice.form), ctx, env)
        o = out["o"].to(q.dtype)
        if not self.spec.is_linear:
            return o
        return o, (out["final_state"].to(dtype) if output_final_state else None)


@lru_cache(maxsize=128)
def _load_cached(spec: Spec) -> Op:
    return Op(spec)


def load(spec: str | Path | Mapping[str, Any] | Spec) -> Op:
    """A spec file, dict or Spec -> its op (cached per spec)."""
    return _load_cached(load_spec(spec))
