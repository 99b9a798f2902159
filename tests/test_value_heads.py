"""Grouped value heads (README.md, "The runtime contract"): a linear op's v, g, beta and state with
HV = G * H heads on q and k with H, value head h reading query / key head h // G, as deployed gated
delta models use. Every kernel form (Triton's interpreter) and every PyTorch form against the
float64 interpreter, forward and gradients, packed sequences, decode through a StateCache; the
forward kernels read q and k in place; a bad HV is a clear error."""
from __future__ import annotations

import pytest
import torch

import attngen
from attngen.reference import reference
from attngen.testing import Shape, compare, random_inputs, rel_error, tolerance

import specs

GROUPS = [1, 2, 4]
H, K, V = 2, 8, 6
# every branch of the forward kernels: decays none / constant / scalar / vector, the delta rule,
# the normalizer, FAVOR+
FORWARD = ("linear_transformer", "performer", "deltanet", "gated_deltanet", "mamba2", "retnet", "gla", "kda",
           "sum_constant")
# the backward kernels of both rules and decays, and a form the kernels recompute through PyTorch
# (the delta rule with a constant decay has no chunked backward kernel)
GRADIENTS = ("linear_transformer", "gated_deltanet", "gla", "kda", "delta_constant")
SERVED = ("gated_deltanet", "kda", "linear_transformer", "mamba2", "retnet")


def op_of(name: str, table=specs.CAUSAL_LINEAR):
    return attngen.load(table[name])


def check(op, shape: Shape, form: str | None, with_grads: bool, chunk: int = 16, decay_strength: float = 1.0):
    inputs = random_inputs(op.spec, shape, decay_strength=decay_strength)
    fn = lambda **kw: op(**kw, form=form, chunk_size=chunk if form == "chunked" else None)
    rows = compare(op.spec, fn, inputs, torch.float32, with_grads=with_grads)
    failures = [f"{n}: error {e:.3g} > tolerance {t:.3g}" for n, e, t in rows if not e <= t]
    assert not failures, f"{op.spec.name} {form} on {shape}:\n" + "\n".join(failures)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("name", FORWARD)
def test_forward(name, G, form, backend):
    """Outputs and final states, three chunks of 16 with a partial last one."""
    check(op_of(name), Shape(batch=2, q_len=37, heads=H, head_dim=K, value_dim=V, value_heads=G * H), form,
          with_grads=False)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("name", GRADIENTS)
def test_gradients(name, G, form, backend):
    """Gradients of every input (dq, dk summed over the G value heads that read each q / k head)."""
    check(op_of(name), Shape(batch=1, q_len=21, heads=H, head_dim=K, value_dim=V, value_heads=G * H), form,
          with_grads=True)


@pytest.mark.parametrize("name", ["gated_deltanet", "gla"])
def test_packed_sequences(name, backend):
    """cu_seqlens: sequences of 5, 20 and 12 tokens, each from its own initial state."""
    check(op_of(name), Shape(batch=1, q_len=37, heads=H, head_dim=K, value_dim=V, value_heads=2 * H,
                             cu_seqlens=(0, 5, 25, 37)), "chunked", with_grads=True)


@pytest.mark.parametrize("name", ["gla", "kda"])
def test_strong_vector_decay(name, backend):
    """Vector decays spanning more than planner.DECAY_SPAN inside a 16-token block: the chunked
    kernels' pairs by offsets (macros.band_keys), reading keys at earlier tokens."""
    check(op_of(name), Shape(batch=1, q_len=37, heads=H, head_dim=K, value_dim=V, value_heads=2 * H), "chunked",
          with_grads=False, decay_strength=40.0)


@pytest.mark.parametrize("name", ["identity", "performer"])
def test_bidirectional(name, backend):
    op = attngen.load(specs.BIDIRECTIONAL[name])
    check(op, Shape(batch=2, q_len=21, heads=H, head_dim=K, value_dim=V, value_heads=2 * H), None, with_grads=True)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_forward_kernels_read_qk_in_place(form, triton_backend, monkeypatch):
    """The forward kernels index q / k head i_h // G: no expanded copy of q or k is made."""
    op = op_of("gated_deltanet")
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=20, heads=H, head_dim=K, value_dim=V, value_heads=4 * H),
                           dtype=torch.float32)

    def refuse(*args, **kwargs):
        raise AssertionError("q or k expanded to the value heads")

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", refuse)
    monkeypatch.setattr(torch, "repeat_interleave", refuse)
    with torch.no_grad():
        o, _ = op(**inputs, form=form, chunk_size=16 if form == "chunked" else None)
    monkeypatch.undo()
    ref, _ = reference(op.spec, **inputs)
    assert rel_error(o, ref) <= tolerance(torch.float32, rel_error(reference(op.spec, **inputs, dtype=torch.float32)[0],
                                                                    ref))


@pytest.mark.parametrize("G", [2, 4])
@pytest.mark.parametrize("name", SERVED)
def test_decode_equals_one_forward(name, G, backend):
    """Two requests prefilled (packed, 3 and 5 tokens) into the slots of a cache of HV heads, then
    decoded token by token by a prepared step of H query / key heads (slots in changing order):
    each request's outputs and final state equal one forward over its whole sequence."""
    op = op_of(name)
    HV, lengths, prefill = G * H, (9, 8), (3, 5)
    reqs = []
    for seed, length in enumerate(lengths):
        x = random_inputs(op.spec, Shape(1, length, H, K, V, value_heads=HV), dtype=torch.float32, seed=seed,
                          initial_state=False)
        if op.spec.decay == "constant":  # a parameter of the layer, the same for every request
            x["g"] = random_inputs(op.spec, Shape(1, 1, H, K, V, value_heads=HV), initial_state=False)["g"]
        reqs.append(x)
    per_token = lambda n, t: n != "g" or t.dim() > 1
    piece = lambda x, a, b: {n: (t[:, a:b].contiguous() if per_token(n, t) else t) for n, t in x.items()}
    cache = attngen.StateCache(op, slots=4, heads=HV, head_dim=K, value_dim=V)
    slot_of = (3, 1)
    outs = [[], []]
    with torch.no_grad():
        pieces = [piece(x, 0, p) for x, p in zip(reqs, prefill)]
        packed = {n: (torch.cat([p[n] for p in pieces], 1) if per_token(n, t) else t) for n, t in pieces[0].items()}
        cu = torch.tensor([0, prefill[0], sum(prefill)], dtype=torch.int32)
        o, _ = op(**packed, cu_seqlens=cu, cache=cache, slots=torch.tensor(slot_of, dtype=torch.int32))
        outs[0].append(o[:, :prefill[0]])
        outs[1].append(o[:, prefill[0]:])
        step = op.prepare_decode(cache, batch=2, heads=H)
        done = list(prefill)
        for t in range(max(lengths) - min(prefill)):
            order = [0, 1] if t % 2 else [1, 0]
            rows = [piece(reqs[r], done[r], done[r] + 1) if done[r] < lengths[r] else piece(reqs[r], 0, 1)
                    for r in order]
            batch = {n: (torch.cat([x[n] for x in rows]) if per_token(n, t_) else t_) for n, t_ in rows[0].items()}
            # a finished request's row is padding (slot -1)
            slots = torch.tensor([slot_of[r] if done[r] < lengths[r] else -1 for r in order], dtype=torch.int32)
            o = step(**batch, slots=slots)
            for i, r in enumerate(order):
                if done[r] < lengths[r]:
                    outs[r].append(o[i:i + 1].clone())
                    done[r] += 1
    for r, x in enumerate(reqs):
        wide = {n: t.to(torch.float64) for n, t in x.items()}
        ref_o, ref_s = reference(op.spec, **wide, output_final_state=True)
        low_o, low_s = reference(op.spec, **wide, output_final_state=True, dtype=torch.float32)
        got_o, got_s = torch.cat(outs[r], 1), cache.state[slot_of[r]][None]
        for what, got, ref, low in (("o", got_o, ref_o, low_o), ("final state", got_s, ref_s, low_s)):
            err, tol = rel_error(got, ref), tolerance(torch.float32, rel_error(low, ref))
            assert err <= tol, f"request {r}: {what} rel err {err:.2e} > tol {tol:.2e}"


def test_value_heads_not_a_multiple():
    op = op_of("gated_deltanet")
    x = random_inputs(op.spec, Shape(1, 5, H, K, V, value_heads=2 * H), initial_state=False)
    with pytest.raises(ValueError, match=r"^v: its heads HV = 3 must be a multiple of the query / key heads H = 2"):
        op(**{**x, "v": x["v"][:, :, :3], "g": x["g"][..., :3], "beta": x["beta"][..., :3]})
    # g and beta are per value head
    with pytest.raises(ValueError, match=r"^g: expected shape \[B, T, HV\] = \[1, 5, 4\], got \[1, 5, 2\]"):
        op(**{**x, "g": x["g"][..., :H]})
    with pytest.raises(ValueError, match=r"^beta: expected shape \[B, T, HV\] = \[1, 5, 4\], got \[1, 5, 2\]"):
        op(**{**x, "beta": x["beta"][..., :H]})
    with pytest.raises(ValueError, match=r"^initial_state: expected shape \[N, HV, F, V\] = \[1, 4, 8, 6\]"):
        op(**x, initial_state=torch.zeros(1, H, K, V))
    cache = attngen.StateCache(op, slots=2, heads=4, head_dim=K, value_dim=V)
    with pytest.raises(ValueError, match=r"^heads: the query / key heads H = 3 must divide the cache's value "
                                         r"heads HV = 4"):
        op.prepare_decode(cache, batch=1, heads=3)
