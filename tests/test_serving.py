"""Serving on a StateCache (README.md, "Serving"): requests joining and leaving a continuous
batch, prefilled in pieces and decoded token by token through their cache slots, equal one
forward over each whole sequence; a prepared decode step does nothing on the host but launch the
kernel; bad use is a clear error. Kernels run through Triton's interpreter on tiny shapes."""
import functools
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attngen
from attngen import runtime, tuning
from attngen.reference import reference
from attngen.testing import Shape, random_inputs, rel_error, tolerance

SPECS = Path(__file__).resolve().parents[1] / "specs"
SERVED = ["deltanet", "gated_deltanet", "gla", "kda", "linear_transformer", "mamba2", "performer", "retnet"]
H, K, V = 2, 8, 6


def shipped(name):
    return attngen.load(SPECS / f"{name}.yaml")


def request_inputs(spec, length, seed, heads=H):
    """One request's tokens [1, length, H, *] (float32 q, k, v); a constant decay's g [H], a
    parameter of the layer, is the same for every request."""
    inputs = random_inputs(spec, Shape(1, length, heads, K, V), dtype=torch.float32, seed=seed, initial_state=False)
    if spec.decay == "constant":
        inputs["g"] = random_inputs(spec, Shape(1, 1, heads, K, V), initial_state=False)["g"]
    return inputs


def tokens(inputs, start, end):
    """Tokens start..end-1 of a request, contiguous (a constant decay's g [H] is not per token)."""
    return {n: (t[:, start:end].contiguous() if n != "g" or t.dim() > 1 else t) for n, t in inputs.items()}


def stack(rows):
    """Per-row inputs [1, T, ...] -> one batch [N, T, ...] (a constant g [H] is shared)."""
    return {n: (torch.cat([r[n] for r in rows]) if rows[0][n].dim() > 1 else rows[0][n]) for n in rows[0]}


def assert_matches_oracle(spec, inputs, o, state, what):
    """o [1, T, H, V] and the final state of one whole request against the float64 interpreter,
    within the float32 tolerance (attngen.testing.tolerance)."""
    wide = {n: t.to(torch.float64) for n, t in inputs.items()}
    ref_o, ref_s = reference(spec, **wide, output_final_state=True)
    low_o, low_s = reference(spec, **wide, output_final_state=True, dtype=torch.float32)
    for name, got, ref, low in (("o", o, ref_o, low_o), ("final state", state, ref_s, low_s)):
        err, tol = rel_error(got, ref), tolerance(torch.float32, rel_error(low, ref))
        assert err <= tol, f"{what}: {name} rel err {err:.2e} > tol {tol:.2e}"


def serve_continuously(op, reqs, plan, cache, step, free, seed, pad):
    """The continuous batching both families' tests run, for 12 steps: the requests of `plan`
    [(length, prefill length, the step it joins at)] that join take a slot from `free` (reset)
    and are prefilled through the cache (two at once packed with cu_seqlens); then every active
    request decodes its next token through the prepared `step`, in a batch whose rows are shuffled
    (random.Random(seed)) and padded with `pad` at slot -1; a request that reaches its length
    leaves and its slot is reused. Returns each request's outputs [1, T, H, V] and the state its
    slot held when it left (None for a key/value cache)."""
    rng = random.Random(seed)
    slot_of, done, outs, left = {}, {}, {r: [] for r in range(len(plan))}, {}
    with torch.no_grad():
        for t in range(12):
            joining = [r for r, (_, _, at) in enumerate(plan) if at == t]
            if joining:
                for r in joining:
                    slot_of[r], done[r] = free.pop(), plan[r][1]
                cache.reset([slot_of[r] for r in joining])
                pieces = [tokens(reqs[r], 0, plan[r][1]) for r in joining]
                packed = {n: (torch.cat([p[n] for p in pieces], 1) if pieces[0][n].dim() > 1 else pieces[0][n])
                          for n in pieces[0]}
                cu = torch.tensor([0, *torch.tensor([plan[r][1] for r in joining]).cumsum(0).tolist()],
                                  dtype=torch.int32)
                slots = torch.tensor([slot_of[r] for r in joining], dtype=torch.int32)
                o = op(**packed, cu_seqlens=cu if len(joining) > 1 else None, cache=cache, slots=slots)
                if op.spec.is_linear:
                    o, none = o
                    assert none is None
                for r, a, b in zip(joining, cu[:-1].tolist(), cu[1:].tolist()):
                    outs[r].append(o[:, a:b])
            active = [r for r in slot_of if r not in left]
            if not active:
                continue
            rows = active + [None] * (step.batch - len(active))
            rng.shuffle(rows)
            batch = stack([tokens(reqs[r], done[r], done[r] + 1) if r is not None else pad for r in rows])
            o = step(**batch, slots=torch.tensor([slot_of[r] if r is not None else -1 for r in rows],
                                                 dtype=torch.int32))
            for i, r in enumerate(rows):
                if r is None:
                    continue
                # a step returns the same tensor every call
                outs[r].append(o[i:i + 1].clone())
                done[r] += 1
                if done[r] == plan[r][0]:
                    left[r] = cache.state[slot_of[r]].clone() if op.spec.is_linear else None
                    free.insert(0, slot_of[r])
    assert set(left) == set(range(len(plan)))
    return {r: torch.cat(o, 1) for r, o in outs.items()}, left


@pytest.mark.parametrize("name", SERVED)
def test_continuous_batching_equals_whole_sequences(name, triton_backend):
    """Requests join (prefilled, two at once packed with cu_seqlens), decode in a batch of 3 rows
    whose order and padding (slot -1) change every step, and leave, their slots reused: each
    request's outputs and final state equal one forward over its whole sequence; slots no request
    holds stay zero."""
    op = shipped(name)
    plan = [(7, 3, 0), (5, 2, 0), (6, 4, 2), (4, 1, 5)]
    reqs = [request_inputs(op.spec, length, seed) for seed, (length, _, _) in enumerate(plan)]
    cache = attngen.StateCache(op, slots=6, heads=H, head_dim=K, value_dim=V)
    outs, finals = serve_continuously(op, reqs, plan, cache, op.prepare_decode(cache, batch=3), free=[5, 1, 3, 0],
                                      seed=0, pad=request_inputs(op.spec, 1, 99))
    for r in range(len(plan)):
        assert_matches_oracle(op.spec, reqs[r], outs[r], finals[r][None], f"request {r}")
    # slot 2 and 4 were never handed out: padding rows (slot -1) wrote nothing
    assert cache.state[[2, 4]].abs().max() == 0


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.lists(st.integers(1, 20), min_size=1, max_size=3), st.sampled_from([None, "chunked"]))
@pytest.mark.parametrize("name", SERVED)
def test_chunked_prefill_equals_one_shot(name, triton_backend, pieces, form):
    """A prompt of two requests prefilled in pieces of random lengths through the cache equals one
    prefill of the whole prompt (both against the interpreter); the planner's forms, or the
    chunked kernel at 16-token chunks (several chunks per piece)."""
    op = shipped(name)
    length = sum(pieces)
    reqs = [request_inputs(op.spec, length, seed, heads=1) for seed in (1, 2)]
    whole = stack(reqs)
    kw = dict(form=form, chunk_size=16) if form else {}
    slots = torch.tensor([3, 0], dtype=torch.int32)
    one_shot = attngen.StateCache(op, slots=4, heads=1, head_dim=K, value_dim=V)
    split = attngen.StateCache(op, slots=4, heads=1, head_dim=K, value_dim=V)
    with torch.no_grad():
        o_one, _ = op(**whole, cache=one_shot, slots=slots, **kw)
        outs, start = [], 0
        for size in pieces:
            o, _ = op(**tokens(whole, start, start + size), cache=split, slots=slots, **kw)
            outs.append(o)
            start += size
    o_split = torch.cat(outs, 1)
    for i, (req, slot) in enumerate(zip(reqs, slots.tolist())):
        assert_matches_oracle(op.spec, req, o_one[i:i + 1], one_shot.state[slot][None], f"one shot, row {i}")
        assert_matches_oracle(op.spec, req, o_split[i:i + 1], split.state[slot][None], f"pieces {pieces}, row {i}")


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_normalizer_in_place_over_value_blocks(triton_backend, form):
    """normalize sum with V wider than one value block (40 > 32): every block's program needs the
    slot's normalizer column, which is written back in place, so no program may read it after
    another has written it."""
    op = shipped("linear_transformer")
    x = random_inputs(op.spec, Shape(1, 5, 1, 4, 40), dtype=torch.float32, initial_state=False)
    cache = attngen.StateCache(op, slots=2, heads=1, head_dim=4, value_dim=40)
    slots = torch.tensor([1], dtype=torch.int32)
    kw = dict(form=form, chunk_size=16) if form == "chunked" else dict(form=form)
    with torch.no_grad():
        o1, _ = op(**tokens(x, 0, 2), cache=cache, slots=slots, **kw)
        o2, _ = op(**tokens(x, 2, 5), cache=cache, slots=slots, **kw)
    assert_matches_oracle(op.spec, x, torch.cat([o1, o2], 1), cache.state[1][None], form)

class TorchCalls(torch.overrides.TorchFunctionMode):
    """Every torch function and tensor method or property called inside, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(torch.overrides.resolve_name(func) or repr(func))
        return func(*args, **(kwargs or {}))


# What a prepared decode step may ask of torch per call: tensor metadata held on the host.
HOST_METADATA = {"torch.Tensor.shape.__get__", "torch.Tensor.dtype.__get__", "torch.Tensor.device.__get__",
                 "torch.Tensor.is_contiguous"}


@pytest.mark.parametrize("name", ["gated_deltanet", "performer"])
def test_decode_step_only_launches(name, triton_backend, monkeypatch):
    """A prepared step's call reads tensor metadata and launches the token loop once, in place
    on the cache: no allocation, no copy, no host read of a tensor (no device sync), nothing a CUDA
    graph could not capture."""
    op = shipped(name)
    module = runtime.kernels_for(op)
    launches = []

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((grid, args, meta))

    monkeypatch.setattr(module, "recurrent_fwd_kernel", Launcher())
    cache = attngen.StateCache(op, slots=4, heads=H, head_dim=K, value_dim=V)
    step = op.prepare_decode(cache, batch=2)
    batch = stack([request_inputs(op.spec, 1, seed) for seed in (0, 1)])
    slots = torch.tensor([3, 1], dtype=torch.int32)
    with torch.no_grad(), TorchCalls() as calls:
        o = step(**batch, slots=slots)
    assert set(calls.names) <= HOST_METADATA, sorted(set(calls.names) - HOST_METADATA)
    assert o is step.out
    (grid, args, meta), = launches
    assert args[6] is cache.state and args[8] is cache.state and args[7] is step.out and args[10] is slots
    assert meta["STATE_INDEXED"] and meta["HAS_H0"] and meta["STORE_HT"]


def test_decode_step_checks_what_it_reads(triton_backend):
    """The step's guard: an input that is not the prepared shape, dtype or layout is an error
    naming it (the kernel would read the wrong elements)."""
    op = shipped("gated_deltanet")
    cache = attngen.StateCache(op, slots=4, heads=H, head_dim=K, value_dim=V)
    step = op.prepare_decode(cache, batch=2)
    batch = stack([request_inputs(op.spec, 2, seed) for seed in (0, 1)])
    slots = torch.tensor([0, 1], dtype=torch.int32)
    one = tokens(batch, 0, 1)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"^q: .*contiguous"):
            step(**dict(one, q=batch["q"][:, :1]), slots=slots)
        with pytest.raises(ValueError, match=r"^q: this decode step was prepared for shape \[2, 1, 2, 8\]"):
            step(**batch, slots=slots)
        with pytest.raises(ValueError, match=r"^q: this decode step was prepared for torch.float32"):
            step(**dict(one, q=one["q"].bfloat16(), k=one["k"].bfloat16(), v=one["v"].bfloat16()), slots=slots)
        with pytest.raises(ValueError, match=r"^beta: this spec has update: delta"):
            step(**dict(one, beta=None), slots=slots)
        with pytest.raises(ValueError, match=r"^slots: expected one slot per sequence"):
            step(**one, slots=slots[:1])


STEP_MISUSE = {
    "float slots": (dict(slots=torch.tensor([0.0, 1.0])),
                    r"^slots: expected a 1-D int32 or int64 tensor .* got \[2\] torch.float32"),
    "int16 slots": (dict(slots=torch.tensor([0, 1], dtype=torch.int16)), r"^slots: expected a 1-D int32 or int64"),
    "slots a list": (dict(slots=[0, 1]), r"^slots: expected a 1-D int32 or int64 tensor .* got list"),
    "q a list": (dict(q=lambda x: x.tolist()), r"^q: expected a tensor of shape"),
    "k on another device": (dict(k=lambda x: x.to("meta")), r"^k: expected device cpu \(that of q\), got meta"),
    "slots on another device": (dict(slots=torch.tensor([0, 1], dtype=torch.int32, device="meta")),
                                r"^slots: expected device cpu \(that of q\), got meta"),
    "integer g": (dict(g=lambda x: x.int()), r"^g: expected a floating dtype"),
    "g on another device": (dict(g=lambda x: x.to("meta")), r"^g: expected device cpu \(that of q\), got meta"),
    "q requires grad": (dict(q=lambda x: x.requires_grad_()), r"^q: requires grad, but a call on a StateCache"),
}


@pytest.mark.parametrize("name", ["gated_deltanet", "forgetting_attention"])
@pytest.mark.parametrize("case", STEP_MISUSE, ids=list(STEP_MISUSE))
def test_decode_step_names_misuse_of_its_prepared_inputs(name, case, triton_backend):
    """What the kernels of a prepared step would read wrongly (slots that are no integer tensor,
    inputs on another device, an integer g) or record nothing for (an input that needs a gradient)
    is an error naming the argument before anything launches, as for a call of the op."""
    op = shipped(name)
    cache = (attngen.StateCache(op, slots=4, heads=H, head_dim=K, value_dim=V) if op.spec.is_linear else
             attngen.StateCache(op, slots=4, heads=H, head_dim=K, value_dim=V, max_len=8))
    step = op.prepare_decode(cache, batch=2)
    args = dict(stack([request_inputs(op.spec, 1, seed) for seed in (0, 1)]),
                slots=torch.tensor([0, 1], dtype=torch.int32))
    change, match = STEP_MISUSE[case]
    for arg, new in change.items():
        args[arg] = new(args[arg].clone()) if callable(new) else new
    with pytest.raises(ValueError, match=match):
        step(**args)
    held = cache.state if op.spec.is_linear else cache.lengths
    assert held.abs().max() == 0


def test_decode_step_validates_slots_in_debug_mode(triton_backend, monkeypatch):
    """ATTNGEN_VALIDATE=1 when the step is prepared: each call checks the slot values too."""
    op = shipped("mamba2")
    cache = attngen.StateCache(op, slots=4, heads=H, head_dim=K, value_dim=V)
    monkeypatch.setenv("ATTNGEN_VALIDATE", "1")
    step = op.prepare_decode(cache, batch=2)
    one = stack([request_inputs(op.spec, 1, seed) for seed in (0, 1)])
    with torch.no_grad(), pytest.raises(ValueError, match=r"^slots: slot 2 at \[1\] appears twice"):
        step(**one, slots=torch.tensor([2, 2], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pytorch_forms_serve_too(dtype):
    """Where the kernels do not run (here the CPU's default backend; float64 inputs everywhere),
    a call on the cache runs the PyTorch forms on the gathered slots and stores the states back;
    padding (slot -1) stores nothing."""
    op = shipped("gated_deltanet")
    reqs = [request_inputs(op.spec, 5, seed) for seed in (0, 1)]
    reqs = [{n: t.to(dtype) if t.is_floating_point() else t for n, t in r.items()} for r in reqs]
    cache = attngen.StateCache(op, slots=3, heads=H, head_dim=K, value_dim=V, dtype=dtype)
    with torch.no_grad():
        o, _ = op(**stack(reqs), cache=cache, slots=torch.tensor([2, -1]))
    assert o.dtype == dtype
    assert_matches_oracle(op.spec, {n: t.float() for n, t in reqs[0].items()}, o[:1].float(),
                          cache.state[2][None].float(), "row 0")
    assert cache.state[:2].abs().max() == 0


def small_cache(op, **kw):
    return attngen.StateCache(op, **{**dict(slots=4, heads=H, head_dim=K, value_dim=V), **kw})


BAD_CACHES = {
    "bidirectional": (lambda: small_cache(shipped("linear_bidirectional")), r"^op: .* mask: bidirectional"),
    "no slots": (lambda: small_cache(shipped("mamba2"), slots=0), r"^slots: expected a positive integer, got 0"),
    "bf16 state": (lambda: small_cache(shipped("mamba2"), dtype=torch.bfloat16), r"^dtype: expected torch.float32"),
    "not an op": (lambda: attngen.StateCache("mamba2", 4, H, K, V), r"^op: expected an attngen op"),
    "not a device": (lambda: small_cache(shipped("mamba2"), device="gpu"),
                     r"^device: expected a torch.device or a device string .* got 'gpu'"),
}


@pytest.mark.parametrize("case", BAD_CACHES, ids=list(BAD_CACHES))
def test_bad_cache_construction(case):
    make, match = BAD_CACHES[case]
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("device, available, why", [
    ("cuda", False, r"this torch has no CUDA support"), ("cuda:3", True, r"torch sees 1 CUDA device\(s\)")])
def test_cache_on_a_device_torch_cannot_run(monkeypatch, device, available, why):
    """A CUDA device where torch cannot run it (no CUDA, or no such GPU) is an error naming the
    device before anything is allocated (torch would fail in its lazy CUDA init)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.version, "cuda", "12.8" if available else None)
    for op in (shipped("mamba2"), shipped("softmax_causal")):
        with pytest.raises(ValueError, match=rf"^device: {device}, but {why}"):
            small_cache(op, device=device, **({} if op.spec.is_linear else {"max_len": 8}))


def _bad_calls():
    op = shipped("gated_deltanet")
    x = stack([request_inputs(op.spec, 3, seed) for seed in (0, 1)])
    slots = torch.tensor([0, 1], dtype=torch.int32)
    cache = small_cache(op)
    return op, x, slots, cache, {
        "another spec's cache": (dict(cache=small_cache(shipped("deltanet"))),
                                 r"^cache: made for spec 'deltanet' .* this op's spec is 'gated_deltanet'"),
        "wrong heads": (dict(cache=small_cache(op, heads=3)),
                        r"^cache: holds states \[slots, H, F, VS\] = \[4, 3, 8, 6\], .* needs \[slots, 2, 8, 6\]"),
        "wrong value dim": (dict(cache=small_cache(op, value_dim=5)), r"^cache: holds states"),
        "float64 cache": (dict(cache=small_cache(op, dtype=torch.float64)),
                          r"^cache: holds torch.float64 states, but torch.float32 inputs need torch.float32"),
        "not a cache": (dict(cache=cache.state), r"^cache: expected an attngen.StateCache, got Tensor"),
        "no slots": (dict(slots=None), r"^cache, slots: a call on a state cache takes both"),
        "float slots": (dict(slots=slots.float()), r"^slots: expected a 1-D int32 or int64 tensor"),
        "slots per token": (dict(slots=torch.zeros(2, 3, dtype=torch.int32)), r"^slots: expected a 1-D"),
        "too few slots": (dict(slots=slots[:1]), r"^slots: expected one slot per sequence, N = 2, got 1"),
        "initial state": (dict(initial_state=cache.state[:2]), r"^initial_state, output_final_state: a call on a"),
        "final state": (dict(output_final_state=True), r"^initial_state, output_final_state"),
        "gradients": (dict(q=x["q"].clone().requires_grad_()), r"^q: requires grad, but a call on a StateCache is"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()[4]))
def test_bad_call_names_the_argument(case):
    op, x, slots, cache, cases = _bad_calls()
    change, match = cases[case]
    args = dict(x, cache=cache, slots=slots)
    args.update(change)
    if args["cache"] is None:
        args.pop("cache")
    with pytest.raises(ValueError, match=match):
        op(**args)
    assert cache.state.abs().max() == 0


@pytest.mark.parametrize("slots, match", [
    ([0, 4], r"^slots: slot 4 at \[1\] is out of range; allowed: 0 .. 3 \(the cache's slots\), or -1"),
    ([-2, 1], r"^slots: slot -2 at \[0\] is out of range"),
    ([3, 3], r"^slots: slot 3 at \[1\] appears twice"),
])
def test_bad_slots_in_debug_mode(monkeypatch, slots, match):
    """ATTNGEN_VALIDATE=1 reads the slots (a host sync) and names a bad one; padding (-1) may repeat."""
    monkeypatch.setenv("ATTNGEN_VALIDATE", "1")
    op, x, _, cache, _ = _bad_calls()
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        op(**x, cache=cache, slots=torch.tensor(slots, dtype=torch.int32))
    with torch.no_grad():
        op(**x, cache=cache, slots=torch.tensor([-1, -1], dtype=torch.int32))


def test_reset_zeroes_only_its_slots():
    cache = small_cache(shipped("mamba2"))
    cache.state.fill_(1.0)
    cache.reset(torch.tensor([2, 0], dtype=torch.int32))
    cache.reset(3)
    assert cache.state[[0, 2, 3]].abs().max() == 0 and (cache.state[1] == 1).all()


@pytest.mark.parametrize("slots, match", [
    (3.5, r"^slots: expected integer slots, got 3\.5"),
    ([True], r"^slots: expected integer slots, got \[True\]"),
    (torch.tensor([1.0]), r"^slots: expected integer slots, got a tensor of torch\.float32"),
    (-1, r"^slots: slot -1 is out of range for a cache of 4 slots"),
    ([0, 4], r"^slots: slot 4 is out of range for a cache of 4 slots"),
])
def test_reset_names_a_bad_slot_and_changes_nothing(slots, match):
    """reset takes integer slots in range only: torch would take a float's integer part, a bool as 0 or 1
    and a negative index from the end, zeroing a slot that another request holds."""
    cache = small_cache(shipped("mamba2"))
    cache.state.fill_(1.0)
    with pytest.raises(ValueError, match=match):
        cache.reset(slots)
    assert (cache.state == 1).all()


def test_torch_compile_fullgraph(triton_backend):
    """A layer calling the op on its cache compiles without a graph break (the registered op that
    mutates the cache) and updates the cache as the eager call does."""
    import torch._functorch.config
    import torch._inductor.config

    op = shipped("gated_deltanet")
    x = stack([request_inputs(op.spec, 3, seed) for seed in (0, 1)])
    slots = torch.tensor([2, 0], dtype=torch.int32)
    eager, compiled = small_cache(op), small_cache(op)

    def layer(cache, q, k, v, g, beta):
        o, _ = op(q, k, v, g, beta, cache=cache, slots=slots)
        return o * 2

    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        want = layer(eager, **x)
        got = torch.compile(layer, fullgraph=True)(compiled, **x)
    assert rel_error(got, want) < 1e-6
    assert rel_error(compiled.state, eager.state) < 1e-6 and eager.state[2].abs().max() > 0


# ---------------------------------------------------------------------------- softmax caches
# a sliding window small enough for its ring to wrap in a short test (L = 4 + 3 - 1 = 6 rows)
SMALL_WINDOW = dict(name="serve_window", attention="softmax", mask="sliding_window", window=4)
# forgetting attention in a sliding window: a ring of log decays too
SMALL_WINDOW_DECAY = dict(name="serve_window_decay", attention="softmax", mask="sliding_window", window=4,
                          decay="scalar")
HQ, HKV = 4, 2


def softmax_op(name):
    variants = {"small_window": SMALL_WINDOW, "small_window_decay": SMALL_WINDOW_DECAY}
    return attngen.load(variants[name]) if name in variants else shipped(name)


def softmax_request(spec, length, seed):
    """One request's q [1, length, HQ, K], k and v [1, length, HKV, *] (grouped-query heads)."""
    return random_inputs(spec, Shape(1, length, HQ, K, V, kv_heads=HKV), dtype=torch.float32, seed=seed)


def softmax_cache(op, slots, **kw):
    rows = dict(max_piece=3) if op.spec.mask == "sliding_window" else dict(max_len=16)
    # with decay, the log decays of the HQ query heads
    heads = dict(query_heads=HQ) if op.spec.decay == "scalar" else {}
    return attngen.StateCache(op, slots=slots, heads=HKV, head_dim=K, value_dim=V, **{**rows, **heads, **kw})


def assert_attends_like_oracle(spec, inputs, o, what):
    wide = {n: t.to(torch.float64) for n, t in inputs.items()}
    ref, low = reference(spec, **wide), reference(spec, **wide, dtype=torch.float32)
    err, tol = rel_error(o, ref), tolerance(torch.float32, rel_error(low, ref))
    assert err <= tol, f"{what}: o rel err {err:.2e} > tol {tol:.2e}"


@pytest.mark.parametrize("name", ["softmax_causal", "sliding_window", "small_window", "forgetting_attention",
                                  "small_window_decay"])
def test_softmax_continuous_batching(name, backend):
    """Softmax layers on a key/value cache: requests prefilled (two packed), then decoded (a
    prepared step) in a batch whose order and padding change every step, leaving and their slots
    reused (serve_continuously); each request's outputs equal attention over its whole sequence
    (grouped-query heads; the small windows' rings of 6 rows wrap; forgetting attention's cache keeps
    each key's cumulative log decay, per query head)."""
    op = softmax_op(name)
    plan = [(9, 3, 0), (6, 2, 0), (7, 3, 2), (5, 1, 4)]
    reqs = [softmax_request(op.spec, length, seed) for seed, (length, _, _) in enumerate(plan)]
    cache = softmax_cache(op, 5)
    outs, _ = serve_continuously(op, reqs, plan, cache, op.prepare_decode(cache, batch=3, heads=HQ), free=[4, 0, 2],
                                 seed=1, pad=softmax_request(op.spec, 1, 99))
    for r in range(len(plan)):
        assert_attends_like_oracle(op.spec, reqs[r], outs[r], f"request {r}")
    # slots 1 and 3 were never handed out: padding stored nothing
    assert cache.lengths[[1, 3]].abs().max() == 0


@pytest.mark.parametrize("name", ["softmax_causal", "sliding_window", "forgetting_attention"])
def test_softmax_decode_step_only_launches(name, triton_backend, monkeypatch):
    """A prepared softmax step's call reads tensor metadata and launches the split forward alone (which
    appends the new keys and values to the cache and merges its partials itself), in place on the cache,
    into buffers allocated when it was prepared: no allocation, no copy, no host read of a tensor; it
    returns the same output tensor every call."""
    op = softmax_op(name)
    module = runtime.kernels_for(op)
    launches = []

    class Launcher:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((self.name, args, meta))

    arg_names = module.softmax_fwd_kernel.arg_names
    for kernel in ("kv_append_kernel", "softmax_fwd_kernel"):
        monkeypatch.setattr(module, kernel, Launcher(kernel))
    cache = softmax_cache(op, 4, **({} if op.spec.mask == "sliding_window" else dict(max_len=512)))
    # a GPU of many multiprocessors, for whom the keys of two queries are split
    monkeypatch.setattr(tuning, "multiprocessors", lambda device: 1024)
    monkeypatch.setattr(tuning, "_remembered", functools.lru_cache(tuning._remembered.__wrapped__))
    step = op.prepare_decode(cache, batch=2, heads=HQ)
    batch = stack([softmax_request(op.spec, 1, seed) for seed in (0, 1)])
    slots = torch.tensor([3, 1], dtype=torch.int32)
    with torch.no_grad(), TorchCalls() as calls:
        o = step(**batch, slots=slots)
        again = step(**batch, slots=slots)
    assert set(calls.names) <= HOST_METADATA, sorted(set(calls.names) - HOST_METADATA)
    assert again is o and tuple(o.shape) == (2, 1, HQ, V)
    names = [n for n, _, _ in launches]
    assert names == ["softmax_fwd_kernel"] * 2, names
    (_, args, meta), (_, args_again, _) = launches
    attend, again_args = dict(zip(arg_names, args)), dict(zip(arg_names, args_again))
    assert attend["k"] is cache.k and attend["v"] is cache.v and attend["kv_slots"] is slots
    assert attend["kv_lens"] is cache.lengths
    # the new keys and values (and log decays), appended by the kernel: the call's own tensors
    assert meta["APPEND"] and attend["k_new"] is batch["k"] and attend["v_new"] is batch["v"]
    if op.spec.decay == "scalar":
        assert attend["g_new"] is batch["g"] and attend["g_hi"] is cache.g_hi and attend["g_lo"] is cache.g_lo
    # a cache's rows are a ring: read by pointers, not tensor descriptors
    assert attend["k_desc"] is None and attend["v_desc"] is None and not meta["TMA"]
    # the merged output is the step's; the partials, the splits' and the sequences' counts are the step's
    # own buffers
    assert meta["SPLIT"] and meta["KV_CACHE"] and attend["o"] is o
    for n in ("split_count", "seq_count"):
        assert attend[n].dtype == torch.int32 and attend[n] is again_args[n]


@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.lists(st.integers(1, 3), min_size=1, max_size=5))
@pytest.mark.parametrize("name", ["softmax_causal", "small_window", "forgetting_attention", "small_window_decay"])
def test_softmax_chunked_prefill(name, triton_backend, pieces):
    """A prompt prefilled into a key/value cache in pieces of random lengths (up to the small
    window's max_piece) equals attention over the whole prompt."""
    op = softmax_op(name)
    reqs = [softmax_request(op.spec, sum(pieces), seed) for seed in (1, 2)]
    whole = stack(reqs)
    cache = softmax_cache(op, 3)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    outs, start = [], 0
    with torch.no_grad():
        for size in pieces:
            outs.append(op(**tokens(whole, start, start + size), cache=cache, slots=slots))
            start += size
    o = torch.cat(outs, 1)
    for i, req in enumerate(reqs):
        assert_attends_like_oracle(op.spec, req, o[i:i + 1], f"pieces {pieces}, row {i}")
    assert cache.lengths.tolist() == [sum(pieces), 0, sum(pieces)]


def test_ring_keys_split_across_programs(triton_backend, monkeypatch):
    """A decode query on a sliding-window ring of exactly window rows (256, max_piece 1), its keys
    split across programs (flash-decoding): the splits start at the first key tile, which lies up
    to a tile before the window, and together reach the query's own key. Against the PyTorch
    forms on the same cache."""
    op = attngen.load(dict(name="serve_window256", attention="softmax", mask="sliding_window", window=256))
    gen = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(2):
        cache = attngen.StateCache(op, slots=2, heads=1, head_dim=16, value_dim=16, max_piece=1)
        cache.k.copy_(torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(1)))
        cache.v.copy_(torch.randn(cache.v.shape, generator=torch.Generator().manual_seed(2)))
        cache.lengths.fill_(299)
        caches.append(cache)
    x = {n: torch.randn(1, 1, 1, 16, generator=gen) for n in ("q", "k", "v")}
    slots = torch.tensor([1], dtype=torch.int32)
    with torch.no_grad():
        got = op(**x, cache=caches[0], slots=slots)
        monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
        want = op(**x, cache=caches[1], slots=slots)
    assert rel_error(got, want) < 1e-6
    assert torch.equal(caches[0].k, caches[1].k) and caches[0].lengths.tolist() == [299, 300]


@pytest.mark.parametrize("name", ["softmax_causal", "sliding_window"])
def test_split_merge_every_step(name, triton_backend, monkeypatch):
    """A prepared decode step whose keys are split across programs (flash-decoding) merges the splits'
    partials in its one kernel: the last split of a query block to finish merges them and sets the
    block's count back to zero, so the next step merges again. Four steps in a row on a cache of
    some 300 keys, each against the PyTorch forms on a twin cache."""
    op = shipped(name)
    # a GPU of many multiprocessors, for whom one query's keys are split
    monkeypatch.setattr(tuning, "multiprocessors", lambda device: 1024)
    monkeypatch.setattr(tuning, "_remembered", functools.lru_cache(tuning._remembered.__wrapped__))
    caches = []
    for _ in range(2):
        rows = dict(max_piece=1) if op.spec.mask == "sliding_window" else dict(max_len=320)
        cache = attngen.StateCache(op, slots=3, heads=HKV, head_dim=K, value_dim=V, **rows)
        cache.k.copy_(torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(1)))
        cache.v.copy_(torch.randn(cache.v.shape, generator=torch.Generator().manual_seed(2)))
        cache.lengths.copy_(torch.tensor([290, 0, 301], dtype=torch.int32))
        caches.append(cache)
    step = op.prepare_decode(caches[0], batch=2, heads=HQ)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for t in range(4):
            x = {"q": torch.randn(2, 1, HQ, K, generator=gen), "k": torch.randn(2, 1, HKV, K, generator=gen),
                 "v": torch.randn(2, 1, HKV, V, generator=gen)}
            got = step(**x, slots=slots).clone()
            monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
            want = op(**x, cache=caches[1], slots=slots)
            monkeypatch.setenv("ATTNGEN_BACKEND", "triton")
            assert rel_error(got, want) < 1e-5, f"step {t}"
    assert caches[0].lengths.tolist() == caches[1].lengths.tolist() == [294, 0, 305]


@pytest.mark.parametrize("name", ["softmax_causal", "sliding_window", "forgetting_attention", "small_window_decay"])
def test_appends_by_launch_and_inside_the_forward(name, triton_backend, monkeypatch):
    """A serving call of more tokens than one query block (a prefill piece) appends its keys and values by
    kv_append_kernel before the forward; a decode step's forward kernel appends them itself (the programs
    that read the new positions write them, the last to finish advances the length), with decay also the
    new positions' G, continued from the slot's last. Both, one after the other on a cache, equal the
    PyTorch forms on a twin cache: the outputs, the cache's rows (G's to rounding) and lengths."""
    op = softmax_op(name)
    module = runtime.kernels_for(op)
    appends = []
    kernel = module.kv_append_kernel

    class Counted:
        def __getitem__(self, grid):
            appends.append(grid)
            return kernel[grid]

    monkeypatch.setattr(module, "kv_append_kernel", Counted())
    caches = []
    decay = op.spec.decay == "scalar"
    for _ in range(2):
        rows = dict(max_piece=80) if op.spec.mask == "sliding_window" else dict(max_len=96)
        caches.append(softmax_cache(op, 3, **rows))
    slots = torch.tensor([2, 0], dtype=torch.int32)
    gen = torch.Generator().manual_seed(4)

    def inputs(T):
        x = {"q": torch.randn(2, T, HQ, K, generator=gen), "k": torch.randn(2, T, HKV, K, generator=gen),
             "v": torch.randn(2, T, HKV, V, generator=gen)}
        if decay:
            x["g"] = torch.nn.functional.logsigmoid(torch.randn(2, T, HQ, generator=gen) + 2)
        return x

    step = op.prepare_decode(caches[0], batch=2, heads=HQ)
    with torch.no_grad():
        for T in (77, 1, 1, 1):
            x = inputs(T)
            got = (op(**x, cache=caches[0], slots=slots) if T > 1 else step(**x, slots=slots)).clone()
            monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
            want = op(**x, cache=caches[1], slots=slots)
            monkeypatch.setenv("ATTNGEN_BACKEND", "triton")
            assert rel_error(got, want) < 1e-5, f"{T} tokens"
            assert len(appends) == 1, f"{T} tokens: {len(appends)} append launches"
    assert caches[0].lengths.tolist() == caches[1].lengths.tolist() == [80, 0, 80]
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    if decay:
        G = [c.g_hi.to(torch.float64) + c.g_lo.to(torch.float64) for c in caches]
        assert G[0][[0, 2], :80].abs().min() > 0
        torch.testing.assert_close(G[0], G[1], rtol=1e-12, atol=1e-12)


SOFTMAX_BAD = {
    "query_heads without decay": (lambda: softmax_cache(shipped("softmax_causal"), 2, query_heads=HQ),
                                  r"^query_heads: only a softmax cache with decay keeps per query head log decays"),
    "query_heads not a multiple": (lambda: softmax_cache(shipped("forgetting_attention"), 2, query_heads=3),
                                   r"^query_heads: the query heads H = 3 must be a multiple of the cache's key / "
                                   r"value heads H_kv = 2"),
    "no max_len": (lambda: attngen.StateCache(shipped("softmax_causal"), 2, HKV, K, V),
                   r"^max_len: a causal softmax cache keeps every key"),
    "max_piece on causal": (lambda: softmax_cache(shipped("softmax_causal"), 2, max_piece=4), r"^max_piece: only"),
    "max_len on linear": (lambda: attngen.StateCache(shipped("mamba2"), 2, H, K, V, max_len=8), r"^max_len, max_piece"),
}


@pytest.mark.parametrize("case", SOFTMAX_BAD, ids=list(SOFTMAX_BAD))
def test_bad_softmax_cache(case):
    make, match = SOFTMAX_BAD[case]
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("change, match", [
    (dict(piece=4), r"^q: a sequence of 4 new tokens on a sliding-window cache of 6 rows \(window 4\) would "
                    r"overwrite keys its first queries need; at most 3"),
    (dict(kv_heads=1), r"^cache: holds keys \[slots, L, H_kv, K\] = \[3, 6, 2, 8\] .* needs H_kv, K, V = \(1, 8, 6\)"),
    (dict(dtype=torch.bfloat16), r"^cache: holds torch.float32 keys, but the inputs are torch.bfloat16"),
    (dict(more_keys=True), r"^k: with a cache, k and v hold the new tokens' keys and values, one per query"),
    (dict(beta=True), r"^beta, initial_state, output_final_state: softmax attention takes none"),
])
def test_bad_softmax_call(change, match):
    op = attngen.load(SMALL_WINDOW)
    cache = softmax_cache(op, 3)
    x = random_inputs(op.spec, Shape(1, change.get("piece", 2), HQ, K, V, kv_heads=change.get("kv_heads", HKV),
                                     k_len=3 if change.get("more_keys") else None), dtype=torch.float32)
    x = {n: t.to(change.get("dtype", torch.float32)) for n, t in x.items()}
    if change.get("beta"):
        x["beta"] = torch.ones(1, 2, HQ)
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        op(**x, cache=cache, slots=torch.tensor([0], dtype=torch.int32))


def test_forgetting_cache_of_other_query_heads():
    """A forgetting attention cache keeps the log decays of its query_heads: a call with other query
    heads is an error naming both."""
    op = shipped("forgetting_attention")
    cache = softmax_cache(op, 2)
    x = random_inputs(op.spec, Shape(1, 2, HKV, K, V, kv_heads=HKV), dtype=torch.float32)
    with torch.no_grad(), pytest.raises(ValueError, match=r"^cache: keeps the log decays of H = 4 query heads \(its "
                                                          r"query_heads\), but this call's q has H = 2"):
        op(**x, cache=cache, slots=torch.tensor([0], dtype=torch.int32))


def test_softmax_cache_room_in_debug_mode(monkeypatch):
    """ATTNGEN_VALIDATE=1: a causal cache (whose rows do not wrap) must have room for the new keys."""
    monkeypatch.setenv("ATTNGEN_VALIDATE", "1")
    op = shipped("softmax_causal")
    cache = softmax_cache(op, 2, max_len=4)
    x = softmax_request(op.spec, 3, 0)
    with torch.no_grad():
        op(**x, cache=cache, slots=torch.tensor([1], dtype=torch.int32))
        with pytest.raises(ValueError, match=r"^slots: slot 1 at \[0\] holds 3 tokens; 3 more exceed its 4 rows"):
            op(**x, cache=cache, slots=torch.tensor([1], dtype=torch.int32))


def test_softmax_torch_compile_fullgraph(triton_backend):
    """A layer appending to and attending over a key/value cache compiles without a graph break
    and leaves the cache as the eager call does."""
    import torch._functorch.config
    import torch._inductor.config

    op = attngen.load(SMALL_WINDOW)
    x = stack([softmax_request(op.spec, 3, seed) for seed in (0, 1)])
    slots = torch.tensor([2, 0], dtype=torch.int32)
    eager, compiled = softmax_cache(op, 3), softmax_cache(op, 3)

    def layer(cache, q, k, v):
        return op(q, k, v, cache=cache, slots=slots) * 2

    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        want = layer(eager, **x)
        got = torch.compile(layer, fullgraph=True)(compiled, **x)
    assert rel_error(got, want) < 1e-6
    assert torch.equal(compiled.k, eager.k) and compiled.lengths.tolist() == eager.lengths.tolist() == [3, 0, 3]
