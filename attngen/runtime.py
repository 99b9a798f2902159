"""The public op: attngen.load(spec) -> an op with the runtime contract of DESIGN.md §2."""
from __future__ import annotations

import dataclasses
import itertools
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Hashable, Mapping

import torch

from . import codegen, compiling, forms, planner, serving, tuning
from .inputs import Call, check_linear, check_softmax, packed_offsets, validate_values, validating
from .signature import LINEAR_CACHED, LINEAR_INPUTS, LINEAR_OP, SOFTMAX_INPUTS, SOFTMAX_OP
from .spec import Spec, load_spec

BACKENDS = ("auto", "triton", "torch")


def backend() -> str:
    value = os.environ.get("ATTNGEN_BACKEND", "auto")
    if value not in BACKENDS:
        raise ValueError(f"ATTNGEN_BACKEND: value {value!r} is not allowed; allowed: {', '.join(BACKENDS)}")
    return value


def _random_features(spec: Spec, head_dim: int) -> torch.Tensor:
    """FAVOR+ Omega [features, head_dim], float64 on the CPU, of a favor_plus spec."""
    from . import algebra

    fp = spec.favor_plus
    return algebra.favor_random_features(fp.features, head_dim, fp.orthogonal, fp.seed)


def _identity(x):
    return x


def _feature_function(spec: Spec):
    """The feature map of a linear spec (not FAVOR+) as a torch function; the identity without sympy."""
    if spec.feature_map == "identity":
        return _identity
    from . import algebra

    return algebra.torch_function(algebra.feature_expr(spec.feature_map, spec.feature_expr))


class Op:
    """A compiled attention op. Linear: op(q, k, v, g, beta, scale, initial_state,
    output_final_state, cu_seqlens) -> (o, final_state); softmax: op(q, k, v, g, scale,
    cu_seqlens) -> o, or (o, lse) with return_lse=True (lse [B, Tq, H]: each query's
    natural-log log-sum-exp of its allowed scaled scores, float32, float64 for float64 inputs;
    differentiable). `form=` and `chunk_size=` force the planner's choice; `cache=` and `slots=`
    serve requests from an attngen.StateCache (serving.py)."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.plan = planner.plan(spec)
        self._omega: dict = {}
        # the feature map as a torch function, built once: a call (and torch.compile's trace of
        # it) runs no sympy
        self._phi = None if spec.feature_map == "favor_plus" or not spec.is_linear else _feature_function(spec)
        # Generated kernels are imported up front where they can run, so a traced call
        # (torch.compile) finds them ready; Triton's one-time work starts beside the import
        self._kernels = None
        if _kernels_possible():
            compiling.warm()
            self._kernels = kernels_for(self)

    def features(self, head_dim: int, device, dtype) -> torch.Tensor | None:
        """FAVOR+ Omega on a device, cached per (K, device, dtype); None for other maps."""
        if self.spec.feature_map != "favor_plus":
            return None
        key = (head_dim, str(device), dtype)
        if key not in self._omega:
            self._omega[key] = _random_features(self.spec, head_dim).to(device=device, dtype=dtype)
        return self._omega[key]

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
        return _random_features(self.spec, head_dim)

    def choose(self, call: Call, form: str | None = None, chunk_size: int | None = None) -> planner.Choice:
        return planner.choose(self.plan, call, form, chunk_size)

    def __call__(self, q, k, v, g=None, beta=None, scale=None, initial_state=None,
                 output_final_state=False, cu_seqlens=None, *, return_lse: bool = False, form: str | None = None,
                 chunk_size: int | None = None, cache: serving.StateCache | None = None, slots=None):
        if cache is not None or slots is not None:
            if return_lse is not False:
                raise ValueError(f"return_lse: a call on a state cache returns no log-sum-exp, got {return_lse!r}")
            return self._serve(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, form,
                               chunk_size, cache, slots)
        call, choice, cu_seqlens = self._prepare(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                 cu_seqlens, return_lse, form, chunk_size)
        if _use_kernels(self.spec, q):
            return self._run_kernels(call, choice, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                                     return_lse)
        return self._run_torch(call, choice, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                               return_lse)

    def kernels(self, q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                cu_seqlens=None, return_lse=False):
        """The call on the generated kernels whatever the backend (the generated module's
        `attention` entry): inputs checked and the form chosen as for a call of the op."""
        call, choice, cu_seqlens = self._prepare(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                 cu_seqlens, return_lse, None, None)
        return self._run_kernels(call, choice, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                                 return_lse)

    def _serve(self, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, form, chunk_size,
               cache, slots):
        """A call on a StateCache: sequence n starts from the state in slot slots[n] and its final
        state is written back there -> (o, None); softmax: its keys and values appended to the
        slot, its queries attending to the slot's keys -> o."""
        if cache is None or slots is None:
            raise ValueError("cache, slots: a call on a state cache takes both (the cache and one slot per sequence)")
        if not self.spec.is_linear:
            return self._serve_keys(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, form,
                                    cache, slots)
        if initial_state is not None or output_final_state:
            raise ValueError("initial_state, output_final_state: a call on a cache reads each sequence's initial "
                             "state from its slot and writes the final state back there; pass neither")
        call = check_linear(self.spec, q, k, v, g, beta, scale, None, cu_seqlens)
        serving.check_cache(self.spec, call, q, cache, slots)
        serving.check_inference(q=q, k=k, v=v, g=g, beta=beta)
        if validating():
            validate_values(q, k, v, g, beta)
            serving.validate_slots(slots, cache.num_slots)
        choice = self.choose(call, form, chunk_size)
        cu_seqlens = packed_offsets(cu_seqlens)
        if _use_kernels(self.spec, q):
            if self._kernels is None:
                self._kernels = kernels_for(self)
            omega = self.features(call.head_dim, q.device, torch.float32)
            kform, launch = kernel_launch(self.spec, choice, call, q.device, q.dtype)
            if not eager(q, k, v, g, beta, cache.state):
                # the registered op (mutating the cache), which torch.compile traces
                return self._kernels.cached_op(*LINEAR_CACHED.bind(
                    q=q, k=k, v=v, g=g, beta=beta, omega=omega, state=cache.state, slots=slots, cu_seqlens=cu_seqlens,
                    scale=call.scale, form=kform, launch=launch)), None
            # eagerly the same launches without the dispatcher's pass over a mutating op (some
            # 80 us of host time per call, bench/decode_host.py)
            args = LINEAR_OP.bind(q=q, k=k, v=v, g=g, beta=beta, omega=omega, initial_state=cache.state,
                                  cu_seqlens=cu_seqlens, scale=call.scale, form=kform, launch=launch,
                                  output_final_state=True, for_backward=False)
            return self._kernels.forward(*args, state_indices=slots)[0], None
        run = lambda s0: self._run_torch(call, choice, q, k, v, g, beta, s0, True, cu_seqlens)
        return serving.run_torch(run, cache, slots), None

    def _serve_keys(self, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, form, cache,
                    slots):
        if beta is not None or initial_state is not None or output_final_state:
            raise ValueError("beta, initial_state, output_final_state: softmax attention takes none of these (they "
                             "are for attention: linear)")
        call = check_softmax(self.spec, q, k, v, g, scale, cu_seqlens)
        serving.check_cache(self.spec, call, q, cache, slots)
        serving.check_inference(q=q, k=k, v=v, g=g)
        if validating():
            validate_values(q, k, v, g)
            serving.validate_slots(slots, cache.num_slots)
            cu = cu_seqlens.tolist() if cu_seqlens is not None else None
            serving.validate_room(cache, slots, [call.q_len] * call.num_seqs if cu is None else
                                  [b - a for a, b in zip(cu, cu[1:])])
        choice = self.choose(call, form)
        cu_seqlens = packed_offsets(cu_seqlens)
        if _use_kernels(self.spec, q):
            if self._kernels is None:
                self._kernels = kernels_for(self)
            args = serving.cached_softmax_args(self.spec, cache, q, k, v, g, slots, cu_seqlens, call.scale,
                                               call.max_len,
                                               cache_launch(self.spec, call, cache.k.shape[1], q.device, q.dtype))
            if not eager(q, k, v, g, cache.k):
                return self._kernels.cached_op(*args)
            return self._kernels.cached_forward(*args)

        def attend(q_n, k_n, v_n, g_n):
            call_n = check_softmax(self.spec, q_n, k_n, v_n, g_n, call.scale)
            return self._run_torch(call_n, choice, q_n, k_n, v_n, g_n, None, None, False, None)

        return serving.run_torch_keys(attend, cache, slots, q, k, v, cu_seqlens, g)

    def cache_launch(self, call: Call, rows: int, device: torch.device, dtype: torch.dtype) -> list[int]:
        """The softmax kernels' launch knobs for a call on a key/value cache (cache_launch)."""
        return cache_launch(self.spec, call, rows, device, dtype)

    def prepare_decode(self, cache: serving.StateCache, batch: int, dtype: torch.dtype = torch.float32,
                       tokens: int = 1, scale: float | None = None, heads: int | None = None) -> serving.DecodeStep:
        """A decode step of `batch` sequences of `tokens` tokens on `cache`, checked and planned once:
        step(q, k, v, g=None, beta=None, *, slots) -> o (serving.DecodeStep); heads: a softmax op's
        query heads (default: the cache's key / value heads), a linear op's query / key heads (dividing
        the cache's value heads: grouped value heads; default: the cache's heads). Where the kernels run (route, read
        now) a call launches them alone; elsewhere it is a call of the op."""
        held = getattr(cache, "state" if self.spec.is_linear else "k", None)
        device = held.device if isinstance(held, torch.Tensor) else torch.device("cpu")
        module = None
        if route(self.spec, device.type, dtype)[0] == "triton":
            module = self._kernels = self._kernels or kernels_for(self)
        return serving.DecodeStep(self, cache, batch, tokens, dtype, scale, module, validating(), heads)

    def _prepare(self, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, return_lse, form,
                 chunk_size):
        if not isinstance(return_lse, bool):
            raise ValueError(f"return_lse: expected True or False, got {return_lse!r}")
        if not isinstance(output_final_state, bool):
            raise ValueError(f"output_final_state: expected True or False, got {output_final_state!r}")
        if self.spec.is_linear:
            if return_lse:
                raise ValueError(f"return_lse: spec {self.spec.name!r} is linear attention, which has no "
                                 "log-sum-exp; return_lse=True is for attention: softmax")
            call = check_linear(self.spec, q, k, v, g, beta, scale, initial_state, cu_seqlens)
        else:
            if beta is not None or initial_state is not None or output_final_state:
                raise ValueError("beta, initial_state, output_final_state: softmax attention takes none of "
                                 "these (they are for attention: linear)")
            call = check_softmax(self.spec, q, k, v, g, scale, cu_seqlens)
        if validating():
            validate_values(q, k, v, g, beta, initial_state)
        return call, self.choose(call, form, chunk_size), packed_offsets(cu_seqlens)

    def _run_torch(self, call, choice, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                   return_lse=False):
        """The PyTorch forms: the plan's stages executed with autograd (a packed call group by
        group of sequences, planner.packed_groups)."""
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        env = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
        if cu_seqlens is None:
            out = self._execute(call, choice, env, dtype)
        else:
            out = self._execute_packed(call, choice, env, dtype)
        o = out["o"].to(q.dtype)
        if not self.spec.is_linear:
            return (o, out["lse"]) if return_lse else o
        return o, (out["final_state"].to(dtype) if output_final_state else None)

    def context(self, call: Call, chunk: int, dtype: torch.dtype, device) -> forms.Ctx:
        """What the PyTorch stages of a call read besides its tensors (dtype: the compute dtype)."""
        return forms.Ctx(self.spec, call, chunk, dtype, device, self.features(call.head_dim, device, dtype), self._phi)

    def _execute(self, call, choice, env, dtype) -> dict:
        ctx = self.context(call, choice.chunk, dtype, env["q"].device)
        return planner.execute(self.plan.form(choice.form), ctx, env)

    def _execute_packed(self, call, choice, env, dtype) -> dict:
        """Each group of packed sequences as a packed call of its own; outputs back in order."""
        cu_seqlens = env["cu_seqlens"]
        cu = cu_seqlens.tolist()
        lengths = [end - start for start, end in zip(cu, cu[1:])]
        groups = planner.packed_groups(lengths, choice)
        if len(groups) == 1:
            return self._execute(call, choice, env, dtype)
        device = cu_seqlens.device
        per_token = ["q", "k", "v", "beta"] + (["g"] if self.spec.decay in ("scalar", "vector") else [])
        outs, tokens, seqs = [], [], []
        for group in groups:
            rows = torch.tensor(group, device=device)
            sizes = [lengths[n] for n in group]
            sub_cu = torch.tensor([0, *itertools.accumulate(sizes)], dtype=cu_seqlens.dtype, device=device)
            # the group's tokens: each sequence's start, shifted to where it lands in the group
            idx = torch.repeat_interleave(cu_seqlens[rows] - sub_cu[:-1], sub_cu[1:] - sub_cu[:-1],
                                          output_size=int(sub_cu[-1])) + torch.arange(int(sub_cu[-1]), device=device)
            sub = dict(env, cu_seqlens=sub_cu)
            for name in per_token:
                if env.get(name) is not None:
                    sub[name] = env[name][:, idx]
            if env.get("initial_state") is not None:
                sub["initial_state"] = env["initial_state"][rows]
            sub_call = dataclasses.replace(call, q_len=len(idx), k_len=len(idx), num_seqs=len(group),
                                           max_len=max(sizes))
            sub_choice = planner.choose(self.plan, sub_call, choice.form,
                                        choice.chunk if choice.form == "chunked" else None)
            outs.append(self._execute(sub_call, sub_choice, sub, dtype))
            tokens.append(idx)
            seqs.append(rows)
        # the inverse permutations: where each token (sequence) of the call went
        token_at = torch.empty(cu[-1], dtype=torch.int64, device=device)
        token_at[torch.cat(tokens)] = torch.arange(cu[-1], device=device)
        out = {name: torch.cat([o[name] for o in outs], 1)[:, token_at] for name in ("o", "lse") if name in outs[0]}
        if "final_state" in outs[0]:
            seq_at = torch.empty(len(lengths), dtype=torch.int64, device=device)
            seq_at[torch.cat(seqs)] = torch.arange(len(lengths), device=device)
            out["final_state"] = torch.cat([o["final_state"] for o in outs])[seq_at]
        return out

    def recompute_grads(self, saved: Mapping[str, Any], rest: tuple, grads: tuple) -> tuple:
        """Gradients of a kernel op's call in a form without backward kernels (the generated
        module's autograd calls this): the same call recomputed through the PyTorch forms and
        differentiated there. saved: the op's tensor inputs by name; rest: its other inputs;
        returns a gradient (or None) per saved input, in order."""
        leaves = {n: t.detach().requires_grad_(True) for n, t in saved.items()
                  if t is not None and t.is_floating_point() and n != "omega"}
        args = {n: leaves.get(n, t) for n, t in saved.items() if n != "omega"}
        with torch.enable_grad():
            if self.spec.is_linear:
                rest = LINEAR_OP.without(*LINEAR_INPUTS.names).named(rest)
                scale, form, launch = rest["scale"], rest["form"], rest["launch"]
                call = check_linear(self.spec, **args, scale=scale)
                chunk = planner.ChunkedLaunch(*launch).chunk if form == "chunked" else 1
                choice = planner.Choice(form, chunk, "recomputed for the backward")
                o, ht = self._run_torch(call, choice, **args, output_final_state=True)
                outs, douts = [o], [grads[0]]
                if rest["output_final_state"] and grads[1] is not None and grads[1].numel():
                    outs.append(ht)
                    douts.append(grads[1])
            else:
                scale = SOFTMAX_OP.without(*SOFTMAX_INPUTS.names).named(rest)["scale"]
                call = check_softmax(self.spec, **args, scale=scale)
                choice = planner.Choice("parallel", 1, "recomputed for the backward")
                o, lse = self._run_torch(call, choice, **args, beta=None, initial_state=None,
                                         output_final_state=False, return_lse=True)
                outs, douts = [o], [grads[0]]
                if grads[1] is not None:
                    # the kernel op's lse is [B, H, Tq] ([H, T] packed)
                    outs.append(lse[0].T if call.varlen else lse.transpose(1, 2))
                    douts.append(grads[1])
            got = torch.autograd.grad(outs, list(leaves.values()), douts, allow_unused=True)
        by_name = dict(zip(leaves, got))
        return tuple(by_name.get(n) for n in saved)

    def _run_kernels(self, call, choice, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                     return_lse=False):
        """The generated Triton kernels, through the op registered with torch.library."""
        if self._kernels is None:
            self._kernels = kernels_for(self)
        module = self._kernels
        form, launch = kernel_launch(self.spec, choice, call, q.device, q.dtype)
        form = form if self.spec.is_linear else "parallel"
        # whether the call's backward runs the kernels: the linear forward then keeps what they reuse
        backward = torch.is_grad_enabled() and form in module.BACKWARD_FORMS and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in (q, k, v, g, beta, initial_state))
        if self.spec.is_linear:
            omega = self.features(call.head_dim, q.device, torch.float32)
            args = LINEAR_OP.bind(q=q, k=k, v=v, g=g, beta=beta, omega=omega, initial_state=initial_state,
                                  cu_seqlens=cu_seqlens, scale=call.scale, form=form, launch=launch,
                                  output_final_state=bool(output_final_state), for_backward=backward)
        else:
            args = SOFTMAX_OP.bind(q=q, k=k, v=v, g=g, cu_seqlens=cu_seqlens, scale=call.scale,
                                   max_len=call.max_len, launch=launch)
        if compiling.applies(q.device):
            # the first call of its kind compiles the forward's and backward's kernels side by side
            names = (LINEAR_OP if self.spec.is_linear else SOFTMAX_OP).names
            kind = (module.__name__, form, tuple(launch), backward, bool(output_final_state),
                    *(_compile_kind(n, a) for n, a in zip(names, args)))
            # (the linear backward's kernels without the decay gradient's terms where g requires no grad)
            backward_kw = dict(decay_grad=g is not None and g.requires_grad) if self.spec.is_linear else {}
            compiling.first_call(kind, lambda: compiling.dry_run(module, args, backward, **backward_kw))
        # through the registered op where autograd records the call or something traces or intercepts it;
        # else its forward, the same launches without the dispatcher's pass over the op (host time of a
        # softmax decode call, bench/decode_host.py)
        run = module.forward if eager(q, k, v, g, beta, initial_state) else module.op
        if not self.spec.is_linear:
            o, lse = run(*args)
            return (o, lse_layout(lse, call.varlen)) if return_lse else o
        o, ht, *_ = run(*args)
        return o, (ht if output_final_state else None)


def eager(*tensors) -> bool:
    """Whether a kernels' call may skip the dispatcher's pass over its registered op and call the
    generated forward: not traced by torch.compile, no Python dispatch or function mode active,
    plain tensors (no subclass: fake, meta-functional, distributed), none requiring a gradient
    while autograd records (the op's autograd would record nothing else)."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled()):
        return False
    grad = torch.is_grad_enabled()
    return all(t is None or (type(t) is torch.Tensor and not (grad and t.requires_grad)) for t in tensors)


def _compile_kind(name: str, value) -> Hashable:
    """What of an op argument selects the compiled kernels, for compiling.first_call: a tensor's
    dtype, whether it needs a gradient and its head and feature sizes, not its batch, token or
    sequence counts (the kernels take those as runtime integers: a training run of varying lengths
    takes the dry run once); of other arguments, whether they are None."""
    if not isinstance(value, torch.Tensor):
        return value is None
    sizes = {"cu_seqlens": (), "initial_state": value.shape[1:]}.get(
        name, value.shape[2:] if name in ("q", "k", "v", "g", "beta") else value.shape)
    return value.dtype, value.requires_grad, tuple(sizes)


def check_call(op: Op, inputs: Mapping[str, Any]) -> Call:
    """The checked call (shapes, lengths) of an op on inputs in the op's signature."""
    q, k, v, g, cu = inputs["q"], inputs["k"], inputs["v"], inputs.get("g"), inputs.get("cu_seqlens")
    if op.spec.is_linear:
        return check_linear(op.spec, q, k, v, g, inputs.get("beta"), None, inputs.get("initial_state"), cu)
    return check_softmax(op.spec, q, k, v, g, None, cu)


def lse_layout(lse: torch.Tensor, varlen: bool) -> torch.Tensor:
    """The softmax kernels' lse, [B, H, Tq] ([H, T] packed), as the contract's [B, Tq, H]: a view
    (the kernels' layout keeps each head's queries adjacent for the backward)."""
    return lse.transpose(0, 1)[None] if varlen else lse.transpose(1, 2)


def kernel_launch(spec: Spec, choice: planner.Choice, call: Call, device: torch.device,
                  dtype: torch.dtype) -> tuple[str, list[int]]:
    """The kernel form serving a choice (planner.kernel_form) and its launch knobs on a device as the
    generated op takes them (planner.Launch.ints; attngen.tuning: a tuned table's, else the planner's
    defaults; [] for kernels without knobs)."""
    form, chunk = planner.kernel_form(spec, choice, call)
    family = planner.launch_family(spec, form)
    return form, list(tuning.launch_ints(spec, family, call, dtype, device, chunk)) if family is not None else []


def cache_launch(spec: Spec, call: Call, rows: int, device: torch.device, dtype: torch.dtype) -> list[int]:
    """The softmax kernels' launch knobs for a call on a key/value cache of `rows` rows per slot: those
    of a call with `rows` keys, the table's bucket that `attngen tune --shapes B,rows,H,K,V,Tq` fills (a
    query block reads up to BN - 1 keys more, a sliding window's first tile starting before the
    window: softmax_fwd splits that span into the launch's kv_splits parts)."""
    return list(tuning.launch_ints(spec, "softmax", call, dtype, device, k_len=rows))


def runs_as(spec: Spec, choice: planner.Choice, call: Call, backend_name: str, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32) -> str:
    """What a call runs, in words: the PyTorch form (and chunk), or the kernel serving its form."""
    if backend_name == "torch":
        return f"{choice.form} C={choice.chunk}" if choice.form == "chunked" else choice.form
    if not spec.is_linear:
        return "softmax kernel"
    if spec.mask == "bidirectional":
        return "bidirectional kernel"
    form, launch = kernel_launch(spec, choice, call, torch.device(device), dtype)
    return f"{form} kernel C={planner.ChunkedLaunch(*launch).chunk}" if form == "chunked" else f"{form} kernel"


def _kernels_possible() -> bool:
    mode = backend()
    return mode == "triton" or (mode == "auto" and torch.cuda.is_available())


# Why float64 inputs of linear specs run the PyTorch forms on every backend.
FLOAT64_REASON = ("float64 inputs of linear attention run the PyTorch forms: the linear kernels compute in "
                  "float32, and float64 is the interpreter's precision")


# Why bf16 inputs of causal FAVOR+ specs with head dims of at most 32 run the PyTorch forms on CUDA.
FAVOR_BF16_REASON = ("bf16 inputs of causal FAVOR+ attention with head_dim <= 32 run the PyTorch forms on CUDA: "
                     "the compiled chunked kernels gave wrong outputs there (Triton 3.6 on the H200, BENCHMARKS.md)")


def route(spec: Spec, device_type: str, dtype: torch.dtype, head_dim: int | None = None) -> tuple[str, str]:
    """("triton" | "torch", why): where a call of `spec` with q of `dtype` (and `head_dim`, where
    known) on a `device_type` device runs; Op.__call__ follows it. auto: the kernels on CUDA, the
    PyTorch forms elsewhere; triton: the kernels (on the CPU through TRITON_INTERPRET=1); torch: the
    PyTorch forms. On every backend, float64 inputs of linear specs run the PyTorch forms
    (FLOAT64_REASON); the softmax kernels accumulate float64 inputs in float64 and run them. On
    CUDA, bf16 inputs of causal FAVOR+ specs at head dims of at most 32 run the PyTorch forms
    (FAVOR_BF16_REASON). Tensors on other devices (meta: shapes without data) run the PyTorch forms
    on every backend."""
    mode = backend()
    if mode == "torch":
        return "torch", "ATTNGEN_BACKEND=torch"
    if mode == "auto" and device_type != "cuda":
        return "torch", f"ATTNGEN_BACKEND=auto: the kernels run on CUDA tensors, these are {device_type}"
    if device_type not in ("cuda", "cpu"):
        # meta tensors (shapes without data) and devices Triton does not run on
        return "torch", f"ATTNGEN_BACKEND={mode}: the kernels run on CUDA tensors (CPU ones through Triton's " \
                        f"interpreter), these are {device_type}"
    if mode == "triton" and device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("ATTNGEN_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 "
                         "(Triton's interpreter); or use ATTNGEN_BACKEND=torch")
    if dtype == torch.float64 and spec.is_linear:
        return "torch", FLOAT64_REASON
    if (device_type == "cuda" and dtype == torch.bfloat16 and spec.feature_map == "favor_plus"
            and spec.mask != "bidirectional" and head_dim is not None and head_dim <= 32):
        # performer bf16 at D = 32, T = 63 and 1000: output errors 30x and 4x the tolerance; at D >= 64,
        # in fp32 and fp16, and the recurrent kernel (T = 1) within it. Cause not found.
        return "torch", FAVOR_BF16_REASON
    where = "Triton's interpreter on the CPU" if device_type == "cpu" else f"{device_type} tensors"
    return "triton", f"ATTNGEN_BACKEND={mode}, {where}"


def _use_kernels(spec: Spec, q: torch.Tensor) -> bool:
    return route(spec, q.device.type, q.dtype, q.shape[-1])[0] == "triton"


def kernels_for(op: Op):
    """The op's generated module; importing it registered its op and autograd (ops of equal
    specs share it)."""
    return codegen.load_module(op.spec)


@lru_cache(maxsize=128)
def _load_cached(spec: Spec, kernels_possible: bool) -> Op:
    return Op(spec)


def load(spec: str | Path | Mapping[str, Any] | Spec) -> Op:
    """A spec file, dict or Spec -> its op (cached per spec, and per whether the kernels can run:
    an op made where they could not, then called under ATTNGEN_BACKEND=triton inside torch.compile,
    would import them while traced, which torch.compile cannot do)."""
    return _load_cached(load_spec(spec), _kernels_possible())
