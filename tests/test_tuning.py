"""Launch knobs (planner.ChunkedLaunch, planner.SoftmaxLaunch) and the tuning tables
(attngen.tuning): the knobs reach the generated kernels; table keys and buckets; a hit used with
no search; a miss takes the nearest bucket or the defaults and warns once with the `attngen tune`
command; a chunk held by the caller stays silent; tables of another GPU or Triton version are
ignored with a warning; a corrupt table is an error naming its file; ATTNGEN_TUNE_DIR and
ATTNGEN_AUTOTUNE; the search loop with a fake timer, and `tune` end to end on the interpreter."""
from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch

import attngen
from attngen import codegen, planner, runtime, tuning
from attngen.inputs import Call
from attngen.testing import Shape, bench_inputs, kernel_launch, random_inputs, rel_error, spy_launches

SPECS = Path(__file__).resolve().parents[1] / "specs"
GDN = attngen.load_spec(SPECS / "gated_deltanet.yaml")
DELTANET = attngen.load_spec(SPECS / "deltanet.yaml")
KDA = attngen.load_spec(SPECS / "kda.yaml")
MAMBA2 = attngen.load_spec(SPECS / "mamba2.yaml")
RETNET = attngen.load_spec(SPECS / "retnet.yaml")
GLA = attngen.load_spec(SPECS / "gla.yaml")
LINEAR_ELU_SUM = attngen.load_spec(SPECS / "linear_transformer.yaml")
PERFORMER = attngen.load_spec(SPECS / "performer.yaml")
MAMBA2_L2 = attngen.load_spec({"name": "mamba2_l2", "attention": "linear", "decay": "scalar", "qk_norm": "l2"})
FAKE = tuning.Machine("NVIDIA Fake GPU", "9.0", "3.6.0")
SMS = 132   # the fake GPU's multiprocessors


def linear_call(B=4, T=8192, H=16, K=128, V=128) -> Call:
    return Call(B, T, T, H, K, V, K, B, T, K ** -0.5, False, H)


@pytest.fixture(autouse=True)
def tables(monkeypatch, tmp_path):
    """Empty shipped and user table directories, and warnings not yet given, for every test."""
    monkeypatch.setattr(tuning, "SHIPPED", tmp_path / "shipped")
    monkeypatch.setenv("ATTNGEN_TUNE_DIR", str(tmp_path / "user"))
    monkeypatch.delenv("ATTNGEN_AUTOTUNE", raising=False)
    monkeypatch.setattr(tuning, "_WARNED", set())
    tuning._tables.cache_clear()
    tuning._sibling_tables.cache_clear()
    tuning._remembered.cache_clear()
    yield
    tuning._tables.cache_clear()
    tuning._sibling_tables.cache_clear()
    tuning._remembered.cache_clear()


def entry(call: Call, launch: planner.Launch, spec=GDN, dtype=torch.bfloat16, family="chunked") -> tuning.Entry:
    return tuning.Entry(tuning.key(spec, family, call, dtype), spec.name, launch, "test")


def default(call: Call, dtype=torch.bfloat16, spec=GDN) -> planner.ChunkedLaunch:
    return planner.chunked_launch(spec, call, dtype)


def resolve(call: Call, dtype=torch.bfloat16, chunk=None, search=None, mach=FAKE, spec=GDN) -> tuning.Chosen:
    return tuning.resolve(spec, "chunked", call, dtype, mach, default(call, dtype, spec), chunk, search)


def no_search():
    raise AssertionError("searched")


# --------------------------------------------------------------------------- the knobs
def test_defaults_are_the_measured_launches():
    """The defaults that moved into the planner (BENCHMARKS.md): bf16 chunked at K = V = 128 takes
    64-token chunks; a scalar-decay delta rule's UT step at two warps over 32-lane value blocks, the
    state pass at four warps over 64 lanes, the output pass at four over 128; three stages, 255
    registers, a backward at 32-token chunks and four warps (64 for bf16 Mamba2, RetNet and the Linear Transformer); fp32 with 256 feature lanes halves the forward's chunk; the
    softmax bf16 D128 forward 64 x 64 tiles at four warps and three stages, its backward dq
    128 x 128 at eight warps, dk/dv 64 x 64 at four, two stages each; at D256 128 x 64 at eight warps,
    dq and dk/dv 64 x 64 at eight, dk and dv apart, their masked tiles by pointers."""
    call = linear_call()
    assert default(call) == planner.ChunkedLaunch(
        chunk=64, BV=32, prepare_warps=2, wu_warps=0, states_BV=64, states_warps=4, stages=3, output_BV=128,
        output_warps=4, maxnreg=255, segments=0, output_in_states=0, bwd_chunk=32, bwd_warps=4, bwd_dq_warps=4, bwd_dk_warps=4, bwd_wy_warps=4, bwd_wu_warps=2, bwd_states_BV=32, bwd_dq_BV=64,
        bwd_dk_BV=64, bwd_wy_BV=128, bwd_stages=3, bwd_ds_stages=3)
    # bf16 delta rules: the backward's dq, dk and UT steps by 128 value lanes (the additive rules' by BV); step 4
    # as one kernel (planner.fused_dq_dk: gated_deltanet above) by 64 at the dq step's knobs, and past 128
    # feature lanes at eight warps
    assert (default(call, spec=KDA).bwd_dk_BV, default(call, spec=MAMBA2).bwd_dq_BV) == (128, 32)
    wide = linear_call(K=256, V=256)
    assert (default(wide).bwd_dq_warps, default(wide, spec=KDA).bwd_dq_warps) == (8, 4)
    # vector decay and additive rules: the UT / keys step at four warps too; fp32: four warps, 32 lanes
    assert default(call, spec=KDA).prepare_warps == 4
    # vector decay: W, U0 and the keys as a kernel of their own at four warps, the backward's UT
    # step at eight; the additive rules have neither kernel
    assert (default(call, spec=KDA).wu_warps, default(call, spec=KDA).bwd_wy_warps) == (4, 8)
    assert all((default(call, spec=s).wu_warps, default(call, spec=s).bwd_wy_warps) == (0, 4) for s in (MAMBA2, GLA))
    # bf16 additive rules with no, scalar or constant decay, no FAVOR+ features and no l2 norm (Mamba2,
    # RetNet, the Linear Transformer): a backward of 64-token chunks, its two state passes unpipelined
    fast = default(call, spec=MAMBA2)
    assert (fast.bwd_chunk, fast.bwd_stages, fast.bwd_ds_stages) == (64, 1, 1)
    assert default(call, spec=RETNET).bwd_chunk == default(call, spec=LINEAR_ELU_SUM).bwd_chunk == 64
    # not where 64 measured slower (vector decay, FAVOR+), nor with the l2 norm, in fp32 or at 256
    # lanes: 32-token chunks, three stages of the state-gradient pass's keys, queries, dU and do
    for held in (default(call, spec=spec) for spec in (GLA, PERFORMER, MAMBA2_L2)):
        assert (held.bwd_chunk, held.bwd_ds_stages) == (32, 3)
    assert default(call, torch.float32, spec=MAMBA2).bwd_chunk == 32
    assert default(linear_call(K=256, V=256), spec=MAMBA2).bwd_chunk == 32
    # the outputs in the state pass for bf16 up to 128 feature lanes (Mamba2, RetNet), the pass by 32 value
    # lanes at four warps (the output pass's knobs held at those); not timed elsewhere: off
    for spec in (MAMBA2, RETNET):
        on = default(call, spec=spec)
        assert (on.output_in_states, on.states_BV, on.states_warps, on.output_BV, on.output_warps) == (1, 32, 4, 32, 4)
        assert default(call, torch.float32, spec=spec).output_in_states == 0
        assert default(linear_call(K=256, V=256), spec=spec).output_in_states == 0
    assert default(call).output_in_states == default(call, spec=LINEAR_ELU_SUM).output_in_states == 0
    # the delta rule without a decay by 64 lanes at four warps (measured faster; with a decay slower: off)
    on = default(call, spec=DELTANET)
    assert (on.output_in_states, on.states_BV, on.states_warps, on.output_BV, on.output_warps) == (1, 64, 4, 64, 4)
    assert default(call, torch.float32, spec=DELTANET).output_in_states == 0
    assert default(call, torch.float32) == planner.ChunkedLaunch(
        chunk=64, BV=32, prepare_warps=4, wu_warps=0, states_BV=32, states_warps=4, stages=2, output_BV=32,
        output_warps=4, maxnreg=255, segments=0, output_in_states=0, bwd_chunk=32, bwd_warps=4, bwd_dq_warps=4, bwd_dk_warps=4, bwd_wy_warps=4, bwd_wu_warps=4, bwd_states_BV=32, bwd_dq_BV=32,
        bwd_dk_BV=32, bwd_wy_BV=32, bwd_stages=3, bwd_ds_stages=2)
    assert default(linear_call(K=256, V=64), torch.float32).chunk == 32
    # vector decay's output pass at 256 feature lanes in fp32: 331,776 B of shared memory at 32 tokens
    for spec in (KDA, GLA):
        assert default(linear_call(K=256, V=256), torch.float32, spec=spec).chunk == 16
        assert default(linear_call(K=128, V=128), torch.float32, spec=spec).chunk == 64
    assert default(linear_call(K=64, V=64), torch.float16).BV == 64
    # bf16 past 128 feature lanes: 32-token forward chunks
    wide = linear_call(K=256, V=256)
    assert [default(wide, spec=spec).chunk for spec in (GDN, MAMBA2, RETNET, LINEAR_ELU_SUM, GLA, PERFORMER, KDA)] \
        == [32] * 7
    assert default(call, spec=MAMBA2).chunk == 64
    # fp32 delta rule: a chunk's W, keys and U0 at 64 tokens fill two stages of the pipeline's budget
    assert default(call, torch.float32).stages == 2
    soft = planner.softmax_launch(Call(4, 8192, 8192, 16, 128, 128, 128, 4, 8192, 0.1, False, 16), torch.bfloat16, 132)
    assert soft == planner.SoftmaxLaunch(BM=64, BN=64, warps=4, stages=3, last_first=1, kv_splits=1, tma=1, dq_BM=128,
                                         dq_BN=128, dq_warps=8, dq_stages=2, dq_tma=1, dkdv_BN=64, dkdv_BM=64, dkdv_warps=4,
                                         dkdv_stages=2, dkdv_tma=1, dkdv_split=0)
    # a decay bias (forgetting attention) at 128 lanes: 128-key tiles in one stage (two programs per SM), the
    # backward's dq on 64-key tiles and dk/dv on 32-query tiles; up to 64 lanes, 128-query forward blocks
    forget = planner.softmax_launch(Call(4, 8192, 8192, 16, 128, 128, 128, 4, 8192, 0.1, False, 16), torch.bfloat16, 132,
                                    decay=True)
    assert (forget.BM, forget.BN, forget.warps, forget.stages, forget.last_first) == (64, 128, 4, 1, 0)
    assert (forget.dq_BM, forget.dq_BN, forget.dkdv_BN, forget.dkdv_BM) == (128, 64, 64, 32)
    narrow = planner.softmax_launch(Call(2, 8192, 8192, 32, 64, 64, 64, 2, 8192, 0.1, False, 32), torch.bfloat16, 132,
                                    decay=True)
    assert (narrow.BM, narrow.BN, narrow.stages, narrow.dq_BN, narrow.dkdv_BM) == (128, 64, 3, 128, 64)
    assert planner.softmax_launch(call := Call(4, 8192, 8192, 16, 128, 128, 128, 4, 8192, 0.1, False, 16), torch.float32,
                                  132, decay=True) == planner.softmax_launch(call, torch.float32, 132)
    # 16-bit past 128 lanes: 128-query forward tiles, the backward's 64 x 64 at eight warps
    wide = planner.softmax_launch(Call(16, 8192, 8192, 8, 256, 256, 256, 16, 8192, 0.1, False, 8), torch.bfloat16, 132)
    assert (wide.BM, wide.BN, wide.warps, wide.stages) == (128, 64, 8, 2)
    assert (wide.dq_BM, wide.dq_BN, wide.dq_warps, wide.dkdv_BN, wide.dkdv_BM, wide.dkdv_warps) == (64, 64, 8, 64, 64, 8)
    assert (wide.dq_tma, wide.dkdv_tma, wide.dkdv_split) == (2, 2, 1)
    # the copy engine's tiles are 16-bit ones: a float32 call's launch holds none, a table's or a search's either
    call = Call(4, 8192, 8192, 16, 128, 128, 128, 4, 8192, 0.1, False, 16)
    fp32 = planner.softmax_launch(call, torch.float32, 132)
    assert (fp32.tma, fp32.dq_tma, fp32.dkdv_tma) == (0, 0, 0)
    held = planner.fit_launch("softmax", None, call, torch.float32, soft)
    assert (held.tma, held.dq_tma, held.dkdv_tma) == (0, 0, 0) and held.BM == soft.BM
    assert planner.fit_launch("softmax", None, call, torch.float16, soft) == soft
    # the backward passes' unmasked tiles alone by the copy engine: a 16-bit call keeps it, a float32 one loads by pointers
    edges = dataclasses.replace(soft, dq_tma=2, dkdv_tma=2)
    assert planner.fit_launch("softmax", None, call, torch.float16, edges) == edges
    assert (planner.fit_launch("softmax", None, call, torch.float32, edges).dq_tma,
            planner.fit_launch("softmax", None, call, torch.float32, edges).dkdv_tma) == (0, 0)
    # decode: one query block per sequence and head, the keys split for two programs per multiprocessor
    decode = planner.softmax_launch(Call(1, 1, 32768, 16, 128, 128, 128, 1, 32768, 0.1, False, 16),
                                    torch.bfloat16, 132)
    assert decode.BM == 16 and decode.kv_splits == 17 and decode.dq_BM == 16


def test_a_launch_is_checked_naming_the_knob():
    with pytest.raises(ValueError, match="ChunkedLaunch.chunk: 48 is not allowed; allowed: 16, 32, 64"):
        dataclasses.replace(default(linear_call()), chunk=48)
    with pytest.raises(ValueError, match="SoftmaxLaunch.BM: 24 is not allowed; allowed: a power of two"):
        planner.SoftmaxLaunch(*([24] + [1] * 17))
    with pytest.raises(ValueError, match=r"SoftmaxLaunch.dkdv_tma: 3 is not allowed; allowed: 0 \(pointers\)"):
        dataclasses.replace(planner.softmax_launch(Call(1, 64, 64, 2, 16, 16, 16, 1, 64, 0.25, False, 2), torch.bfloat16, 132), dkdv_tma=3)
    with pytest.raises(ValueError, match="ChunkedLaunch.states_warps: True"):
        dataclasses.replace(default(linear_call()), states_warps=True)


def test_fit_holds_a_launch_to_the_call():
    """A launch from another shape or a forced chunk: value blocks no wider than the values, the
    held chunk on both passes (the backward's at most it), stages within the shared memory."""
    small = linear_call(K=16, V=16)
    wide = dataclasses.replace(default(linear_call()), BV=128, states_BV=128, output_BV=128, chunk=64, bwd_chunk=64)
    fitted = planner.fit_chunked(GDN, small, torch.bfloat16, wide, chunk=16)
    assert (fitted.BV, fitted.states_BV, fitted.output_BV, fitted.chunk, fitted.bwd_chunk) == (16, 16, 16, 16, 16)
    stages = planner.fit_chunked(GDN, linear_call(), torch.float32, dataclasses.replace(wide, stages=3)).stages
    assert stages == planner.pipeline_stages(planner.chunked_stage_bytes(GDN, 64, 128, 128, torch.float32)) == 1
    # bf16 at four warps or more in a scalar-decay delta rule's UT step or the backward: chunks of at
    # most 32 tokens (Triton 3.6's 64-row wgmma miscompile)
    warpgroup = planner.fit_chunked(GDN, linear_call(), torch.bfloat16,
                                    dataclasses.replace(wide, prepare_warps=4, bwd_warps=8))
    assert (warpgroup.chunk, warpgroup.bwd_chunk) == (32, 32)
    # so do the UT step's second kernel and the backward's UT step at four warps or more
    split = planner.fit_chunked(GDN, linear_call(), torch.bfloat16,
                                dataclasses.replace(wide, prepare_warps=2, wu_warps=4, bwd_warps=2, bwd_wy_warps=8))
    assert (split.chunk, split.bwd_chunk) == (32, 32)
    # an additive rule has no UT step: its knobs are held where a search does not move them
    additive = planner.fit_chunked(MAMBA2, linear_call(), torch.bfloat16, dataclasses.replace(wide, wu_warps=4,
                                                                                              bwd_wy_warps=8))
    assert (additive.wu_warps, additive.bwd_wy_warps) == (0, 4)
    assert planner.fit_chunked(GDN, linear_call(), torch.float16, dataclasses.replace(wide, prepare_warps=4)).chunk == 64
    # the forward's other steps, and a vector-decay rule's UT step, keep 64-token chunks at four warps
    # or more (verified on the H200)
    steps = dataclasses.replace(wide, states_warps=8, output_warps=8)
    assert planner.fit_chunked(GDN, linear_call(), torch.bfloat16, steps).chunk == 64
    assert planner.fit_chunked(KDA, linear_call(), torch.bfloat16, dataclasses.replace(steps, prepare_warps=4)).chunk == 64
    # bf16 with the sum normalizer: the output pass at 128 value lanes (illegal addresses at 16 and 32)
    narrow = dataclasses.replace(wide, output_BV=16)
    assert planner.fit_chunked(LINEAR_ELU_SUM, linear_call(), torch.bfloat16, narrow).output_BV == 128
    assert planner.fit_chunked(LINEAR_ELU_SUM, linear_call(V=64), torch.bfloat16, narrow).output_BV == 64
    assert planner.fit_chunked(LINEAR_ELU_SUM, linear_call(), torch.float32, narrow).output_BV == 16
    # bf16 up to 128 feature lanes: the output pass at 64 value lanes or more, the delta rule's state
    # pass at one stage by 64 or more (illegal addresses at 16 lanes, and at one stage and 32 lanes)
    assert planner.fit_chunked(GDN, linear_call(), torch.bfloat16, narrow).output_BV == 64
    assert planner.fit_chunked(GDN, linear_call(V=32), torch.bfloat16, narrow).output_BV == 32
    assert planner.fit_chunked(GDN, linear_call(K=256, V=256), torch.bfloat16, narrow).output_BV == 16
    assert planner.fit_chunked(GDN, linear_call(), torch.float32, narrow).output_BV == 16
    one_stage = dataclasses.replace(wide, stages=1, states_BV=32)
    assert planner.fit_chunked(GDN, linear_call(), torch.bfloat16, one_stage).states_BV == 64
    assert planner.fit_chunked(GDN, linear_call(), torch.bfloat16, dataclasses.replace(one_stage, stages=3)).states_BV == 32
    assert planner.fit_chunked(MAMBA2, linear_call(), torch.bfloat16, one_stage).states_BV == 32
    # the outputs in the state pass: only where the spec can (planner.output_in_states); there, no output pass
    # runs, so its knobs are held at the state pass's, and the pass's stages make room for q's tiles
    fused = dataclasses.replace(wide, output_in_states=1, states_BV=64, states_warps=8, output_BV=128,
                                output_warps=4, stages=3)
    assert planner.fit_chunked(GDN, linear_call(), torch.bfloat16, fused).output_in_states == 1
    # the delta rules' in bf16 only (float32 tiles past the shared memory), their pass loading q and k too
    assert planner.fit_chunked(GDN, linear_call(), torch.float32, fused).output_in_states == 0
    assert planner.chunked_stage_bytes(GDN, 32, 128, 64, torch.bfloat16, outputs=True) == 32 * (2 * 128 * 2 + 64 * 2 + 2 * 128 * 2)
    assert planner.fit_chunked(LINEAR_ELU_SUM, linear_call(), torch.bfloat16, fused).output_in_states == 0
    on = planner.fit_chunked(MAMBA2, linear_call(), torch.bfloat16, fused)
    assert (on.output_in_states, on.output_BV, on.output_warps) == (1, 64, 8)
    assert planner.chunked_stage_bytes(MAMBA2, 64, 128, 64, torch.bfloat16, outputs=True) == 64 * (128 * 2 + 64 * 2 + 128 * 2)
    assert planner.fit_chunked(MAMBA2, linear_call(), torch.float32, fused).stages == planner.pipeline_stages(
        planner.chunked_stage_bytes(MAMBA2, 64, 128, 64, torch.float32, outputs=True)) == 2
    assert planner.fit_chunked(MAMBA2, linear_call(), torch.float32, dataclasses.replace(fused, output_in_states=0)).stages == 3


def linear_grads(module, inputs, form, launch) -> list:
    """A generated linear module's output at a launch and the gradients of its sum w.r.t. its inputs."""
    names = [n for n in ("q", "k", "v", "g", "beta") if inputs.get(n) is not None]
    leaves = {n: inputs[n].detach().clone().requires_grad_(True) for n in names}
    o = module.op(*[leaves.get(n) for n in ("q", "k", "v", "g", "beta")], None, None, None, 0.25, form,
                  launch.ints(), False)[0]
    return [o.detach(), *torch.autograd.grad(o, list(leaves.values()), torch.ones_like(o))]


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("name", ["gated_deltanet", "softmax_causal"])
def test_launch_knobs_reach_the_kernels(name, monkeypatch):
    """The generated module takes its launch as the planner's ints, in the planner's field order,
    and passes each knob to the kernel launches it belongs to; two launches give the same outputs."""
    op = attngen.load(SPECS / f"{name}.yaml")
    module = codegen.load_module(op.spec)
    family = planner.launch_family(op.spec)
    cls = planner.LAUNCHES[family]
    named = module.ChunkedLaunch if family == "chunked" else module.SoftmaxLaunch
    assert named._fields == cls.knobs()
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=70, heads=2, head_dim=16, value_dim=24), dtype=torch.float32,
                           initial_state=False)
    form, ints = kernel_launch(op, inputs)
    base = cls(*ints)
    if family == "chunked":
        other = dataclasses.replace(base, chunk=32, states_BV=16, states_warps=8, stages=1, maxnreg=128)
        kernel = "chunked_states_kernel"
        knobs = {"BT": 32, "BV": 16, "num_warps": 8, "num_stages": 1, "maxnreg": 128}
    else:
        other = dataclasses.replace(base, BM=32, BN=32, warps=8, stages=2, last_first=0)
        kernel, knobs = "softmax_fwd_kernel", {"BM": 32, "BN": 32, "num_warps": 8, "num_stages": 2,
                                               "LAST_FIRST": False}
    launches = spy_launches(monkeypatch, module, [kernel])
    q, k, v, g, beta = (inputs.get(n) for n in ("q", "k", "v", "g", "beta"))

    def run(launch):
        if family == "chunked":
            return module.op(q, k, v, g, beta, None, None, None, 0.25, form, launch.ints(), False)[0]
        return module.op(q, k, v, g, None, 0.25, 70, launch.ints())[0]

    want, got = run(base), run(other)
    first, last = launches[0][2], launches[-1][2]
    assert all(last[n] == value for n, value in knobs.items()), last
    assert any(first[n] != value for n, value in knobs.items())
    assert rel_error(got, want) < 1e-5


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("name", ["gated_deltanet", "mamba2", "gla"])
def test_the_backward_steps_take_their_own_warps(name, monkeypatch):
    """bwd_warps launches the backward's dU step (the dv step after the pass: planner.dv_after_states) and
    state-gradient pass, bwd_dq_warps its dq step and bwd_dk_warps its dk step, each at its own; the
    gradients are the same at any warps."""
    op = attngen.load(SPECS / f"{name}.yaml")
    module = codegen.load_module(op.spec)
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=70, heads=2, head_dim=16, value_dim=24), dtype=torch.float32,
                           initial_state=False)
    form, ints = kernel_launch(op, inputs)
    base = planner.ChunkedLaunch(*ints)
    other = dataclasses.replace(base, bwd_warps=2, bwd_dq_warps=8, bwd_dk_warps=4)
    local = "chunked_bwd_dv_kernel" if planner.dv_after_states(op.spec) else "chunked_bwd_du_local_kernel"
    # step 4 in one kernel at bwd_dq_warps (planner.fused_dq_dk), or its dq and dk steps
    step4 = (["chunked_bwd_dqk_kernel"] if planner.fused_dq_dk(op.spec)
             else ["chunked_bwd_dq_kernel", "chunked_bwd_dk_kernel"])
    kernels = [local, "chunked_bwd_states_kernel", *step4]
    launches = spy_launches(monkeypatch, module, kernels)
    want = linear_grads(module, inputs, form, base)
    launches.clear()
    got = linear_grads(module, inputs, form, other)
    warps = {name: kw["num_warps"] for name, _, kw in launches}
    expected = {local: 2, "chunked_bwd_states_kernel": 2, "chunked_bwd_dq_kernel": 8, "chunked_bwd_dk_kernel": 4,
                "chunked_bwd_dqk_kernel": 8}
    assert warps == {k: expected[k] for k in kernels}, warps
    assert all(rel_error(g, w) < 1e-5 for g, w in zip(got, want))


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("name", ["gated_deltanet", "kda"])
def test_the_ut_steps_split_and_warps_reach_the_kernels(name, monkeypatch):
    """wu_warps > 0 launches the UT step as two kernels (the inverse, then chunked_wu_kernel at those
    warps) in the forward and in the backward's recomputation, 0 as one; bwd_wy_warps is the warps of
    the backward's UT step. Both ways give the same outputs and gradients, bit for bit (the same
    operations on the same values)."""
    op = attngen.load(SPECS / f"{name}.yaml")
    module = codegen.load_module(op.spec)
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=40, heads=1, head_dim=16, value_dim=16), dtype=torch.float32,
                           initial_state=False)
    form, ints = kernel_launch(op, inputs)
    base = dataclasses.replace(planner.ChunkedLaunch(*ints), chunk=32, bwd_chunk=32)
    spied = spy_launches(monkeypatch, module, ("chunked_ut_kernel", "chunked_wu_kernel", "chunked_bwd_wy_kernel"))

    def launches():
        return [(kernel, kw.get("FUSED_WU"), kw["num_warps"]) for kernel, _, kw in spied]

    fused = linear_grads(module, inputs, form, dataclasses.replace(base, wu_warps=0, bwd_wy_warps=4))
    assert [k for k, *_ in launches()] == ["chunked_ut_kernel", "chunked_ut_kernel", "chunked_bwd_wy_kernel"]
    assert launches()[0][1] is True and launches()[-1][2] == 4
    spied.clear()
    split = linear_grads(module, inputs, form, dataclasses.replace(base, wu_warps=2, bwd_wy_warps=8))
    assert launches() == [("chunked_ut_kernel", False, base.prepare_warps), ("chunked_wu_kernel", None, 2),
                          ("chunked_ut_kernel", False, base.prepare_warps), ("chunked_wu_kernel", None, 2),
                          ("chunked_bwd_wy_kernel", None, 8)]
    for a, b in zip(split, fused):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("name", ["mamba2", "gated_deltanet"])
def test_the_backward_state_pass_takes_value_blocks_of_its_own(name, monkeypatch):
    """bwd_states_BV is the value lanes of the backward's sequential state-gradient pass (its grid and
    BV), apart from BV, which the chunk-parallel kernels keep; the gradients do not depend on it."""
    op = attngen.load(SPECS / f"{name}.yaml")
    module = codegen.load_module(op.spec)
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=40, heads=1, head_dim=16, value_dim=32), dtype=torch.float32,
                           initial_state=False)
    form, ints = kernel_launch(op, inputs)
    base = dataclasses.replace(planner.ChunkedLaunch(*ints), BV=32, bwd_states_BV=32)
    step4 = "chunked_bwd_dqk_kernel" if planner.fused_dq_dk(op.spec) else "chunked_bwd_dq_kernel"
    spied = spy_launches(monkeypatch, module, ("chunked_bwd_states_kernel", step4))
    want = linear_grads(module, inputs, form, base)
    spied.clear()
    got = linear_grads(module, inputs, form, dataclasses.replace(base, bwd_states_BV=16))
    # (grid[:2]: the additive rule's pass has an axis of segments too, one here)
    assert [(k, grid[:2], kw["BV"]) for k, grid, kw in spied] == [("chunked_bwd_states_kernel", (1, 2), 16),
                                                             (step4, (2,), 32)]
    assert all(rel_error(a, b) < 1e-6 for a, b in zip(got, want))


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("name", ["mamba2", "gated_deltanet", "gla"])
def test_the_backward_steps_take_value_blocks_of_their_own(name, monkeypatch):
    """bwd_dq_BV, bwd_dk_BV and bwd_wy_BV (the delta rules' UT step) are the value lanes of the value
    loops of the backward's dq, dk and UT steps, apart from BV (the forward's prepare step and the
    backward's dU step) and from each other; the gradients do not depend on them."""
    op = attngen.load(SPECS / f"{name}.yaml")
    module = codegen.load_module(op.spec)
    inputs = random_inputs(op.spec, Shape(batch=1, q_len=40, heads=1, head_dim=16, value_dim=64), dtype=torch.float32,
                           initial_state=False)
    form, ints = kernel_launch(op, inputs)
    base = dataclasses.replace(planner.ChunkedLaunch(*ints), BV=32, bwd_dq_BV=32, bwd_dk_BV=32, bwd_wy_BV=32)
    kernels = ("chunked_bwd_du_local_kernel", "chunked_bwd_dv_kernel", "chunked_bwd_dq_kernel", "chunked_bwd_dk_kernel",
               "chunked_bwd_dqk_kernel", "chunked_bwd_wy_kernel")
    spied = spy_launches(monkeypatch, module, tuple(k for k in kernels if hasattr(module, k)))
    want = linear_grads(module, inputs, form, base)
    spied.clear()
    got = linear_grads(module, inputs, form, dataclasses.replace(base, bwd_dq_BV=16, bwd_dk_BV=64, bwd_wy_BV=16))
    # (step 4 in one kernel, planner.fused_dq_dk: at bwd_dq_BV)
    blocks = {"chunked_bwd_du_local_kernel": 32, "chunked_bwd_dv_kernel": 32, "chunked_bwd_dq_kernel": 16, "chunked_bwd_dk_kernel": 64,
              "chunked_bwd_dqk_kernel": 16, "chunked_bwd_wy_kernel": 16}
    assert [(k, kw["BV"]) for k, _, kw in spied] == [(k, blocks[k]) for k in kernels if hasattr(module, k)]
    assert all(rel_error(a, b) < 1e-6 for a, b in zip(got, want))


# --------------------------------------------------------------------------- keys and lookups
def test_bucket_rounds_up_to_powers_of_two():
    assert tuning.bucket(linear_call(B=3, T=1000, H=5, K=100, V=8)) == tuning.Bucket(1024, 1024, 16, 128, 16)
    packed = Call(1, 3000, 3000, 2, 64, 64, 64, 7, 900, 0.125, True, 2)
    assert tuning.bucket(packed) == tuning.Bucket(1024, 1024, 16, 64, 64)
    decode = Call(2, 1, 5000, 8, 64, 32, 64, 2, 5000, 0.125, False, 2)
    assert tuning.bucket(decode) == tuning.Bucket(16, 8192, 16, 64, 32)
    a, b = (tuning.key(GDN, "chunked", linear_call(), d) for d in (torch.bfloat16, torch.float16))
    assert a != b and a.spec_hash == GDN.hash and a.dtype == "bfloat16"


def test_a_hit_is_used_with_no_search_and_no_warning(monkeypatch):
    call = linear_call()
    tuned = dataclasses.replace(default(call), BV=64, maxnreg=128)
    tuning.record([entry(call, tuned)], FAKE)
    monkeypatch.setenv("ATTNGEN_AUTOTUNE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = resolve(linear_call(B=4, T=7000), search=no_search)
    assert chosen.launch == tuned and chosen.source.startswith("tuned (")


def test_a_miss_takes_the_nearest_bucket_and_warns_once_with_the_command():
    call = linear_call()
    near = dataclasses.replace(default(call), BV=64)
    far = dataclasses.replace(default(call), BV=128)
    other_dims = dataclasses.replace(default(call), BV=16)
    tuning.record([entry(linear_call(T=4096), near), entry(linear_call(T=65536), far),
                   entry(linear_call(T=8192, K=64, V=64), other_dims)], FAKE)
    with pytest.warns(UserWarning) as got:
        chosen = resolve(call)
    assert chosen.launch == near and "nearest bucket" in chosen.source
    message = str(got[0].message)
    assert "no tuned chunked launch of spec 'gated_deltanet'" in message and "nearest tuned bucket" in message
    assert got[0].filename == __file__   # the warning names the caller's line, not attngen's
    assert f"`attngen tune {GDN.source} --shapes 4,8192,16,128,128 --dtype bfloat16`" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve(call).launch == near
    # no entry of these head dims: the defaults, warned about once too
    with pytest.warns(UserWarning, match="using the defaults"):
        assert resolve(linear_call(K=256, V=256)).launch == default(linear_call(K=256, V=256))
    # nor within two octaves of T and B*H: a launch tuned for another regime is not taken
    with pytest.warns(UserWarning, match="using the defaults"):
        assert resolve(linear_call(T=512)).launch == default(linear_call(T=512))
    with pytest.warns(UserWarning, match="nearest tuned bucket"):   # T 1 octave and B*H 2 from 4096 / 64
        assert resolve(linear_call(T=8192, B=16)).launch == near


def test_a_nearest_bucket_launch_fills_the_gpu_by_segments():
    """A launch tuned for the nearest bucket is taken as it is, but for the delta rules' state passes
    that split a long sequence into segments (kernel_lib.chunked_state_segments: their programs leave
    SMs idle): those at 64 value lanes at least (planner.segment_lanes), not narrower."""
    tuned = dataclasses.replace(default(linear_call()), states_BV=64, bwd_states_BV=32)
    tuning.record([entry(linear_call(), tuned)], FAKE)
    with pytest.warns(UserWarning, match="nearest tuned bucket"):
        assert resolve(linear_call(B=1, T=32768)).launch == dataclasses.replace(tuned, bwd_states_BV=64)
    assert resolve(linear_call()).launch == tuned
    # a tuned count of segments is its bucket's: another bucket takes the policy's (1, no split, tuned where
    # B4's programs fill the GPU, would leave B1 T32768's pass on 16 programs)
    tuning.record([entry(linear_call(), dataclasses.replace(tuned, segments=1))], FAKE)
    with pytest.warns(UserWarning, match="nearest tuned bucket"):
        assert resolve(linear_call(B=1, T=16384)).launch == dataclasses.replace(tuned, bwd_states_BV=64)
    assert resolve(linear_call()).launch.segments == 1
    # one segment (the launch's segments=1; packed sequences) keeps the 32 lanes, and so does an additive rule
    call = linear_call(B=1, T=32768)
    assert planner.fit_chunked(GDN, call, torch.bfloat16, dataclasses.replace(tuned, segments=1)).bwd_states_BV == 32
    assert planner.fit_chunked(GDN, dataclasses.replace(call, varlen=True), torch.bfloat16, tuned).bwd_states_BV == 32
    mamba = dataclasses.replace(default(call, spec=MAMBA2), states_BV=32, bwd_states_BV=32)
    assert planner.fit_chunked(MAMBA2, call, torch.bfloat16, mamba).bwd_states_BV == 32
    # the default too: the planner's, whatever the GPU's multiprocessors
    assert planner.default_launch("chunked", GDN, linear_call(B=1), torch.bfloat16, 32) == default(linear_call(B=1))


def test_a_held_chunk_takes_the_table_silently():
    call = linear_call()
    tuning.record([entry(call, dataclasses.replace(default(call), BV=64))], FAKE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        held = resolve(call, chunk=16)
        missed = resolve(linear_call(T=100), chunk=32)
    assert (held.launch.chunk, held.launch.bwd_chunk, held.launch.BV) == (16, 16, 64)
    assert (missed.launch.chunk, missed.launch.bwd_chunk) == (32, 32)


def test_a_call_takes_the_launch_tables_give_once_remembered(monkeypatch, tmp_path):
    """The runtime's lookup (launch_ints) on a machine with tables: the defaults on a miss, then a
    table written by this process, then another user directory's: each change is seen, and a
    lookup is remembered (not made again)."""
    monkeypatch.setattr(tuning, "machine", lambda device: FAKE)
    call = linear_call()
    lookup = lambda: planner.ChunkedLaunch(*tuning.launch_ints(GDN, "chunked", call, torch.bfloat16,  # noqa: E731
                                                                torch.device("cpu")))
    with pytest.warns(UserWarning, match="no tuned chunked launch"):
        assert lookup() == default(call)
    tuned = dataclasses.replace(default(call), BV=64)
    tuning.record([entry(call, tuned)], FAKE)
    assert lookup() == tuned
    real_choose = tuning.choose
    monkeypatch.setattr(tuning, "choose", no_search)
    assert lookup() == tuned
    monkeypatch.setattr(tuning, "choose", real_choose)
    monkeypatch.setenv("ATTNGEN_TUNE_DIR", str(tmp_path / "elsewhere"))
    assert lookup() == default(call)


def test_off_cuda_the_defaults_and_no_tables():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = tuning.choose(GDN, "chunked", linear_call(), torch.float32, "cpu")
    assert chosen.launch == default(linear_call(), torch.float32) and "off CUDA" in chosen.source


def test_user_tables_override_shipped_ones_and_the_env_picks_their_directory(tmp_path, monkeypatch):
    call = linear_call()
    shipped, mine = (dataclasses.replace(default(call), BV=bv) for bv in (64, 128))
    tuning.record([entry(call, shipped)], FAKE, tuning.SHIPPED)
    assert resolve(call).launch == shipped
    tuning.record([entry(call, mine)], FAKE)
    assert (tmp_path / "user" / FAKE.file_name()).exists()
    assert resolve(call).launch == mine
    monkeypatch.delenv("ATTNGEN_TUNE_DIR")
    monkeypatch.setenv("ATTNGEN_CACHE", str(tmp_path / "cache"))
    assert tuning.tune_dir() == tmp_path / "cache" / "tune"


def test_tables_of_another_gpu_or_triton_are_ignored_with_a_warning():
    call = linear_call()
    tuned = dataclasses.replace(default(call), BV=128)
    stale = dataclasses.replace(FAKE, triton="3.5.0")
    tuning.record([entry(call, tuned)], stale)
    # shipped for another GPU of another architecture, or of this one with another Triton: not this
    # one's, and nothing to say about it
    tuning.record([entry(call, tuned)], tuning.Machine("Other GPU", "10.0", "3.6.0"), tuning.SHIPPED)
    tuning.record([entry(call, tuned)], tuning.Machine("Third GPU", "9.0", "3.5.0"), tuning.SHIPPED)
    with pytest.warns(UserWarning) as got:
        chosen = resolve(call)
    assert chosen.launch == default(call)
    messages = [str(w.message) for w in got]
    assert any(f"ignoring the tuning table {tuning.tune_dir() / stale.file_name()}" in m and "Triton 3.5.0" in m
               for m in messages), messages
    assert not any("Other GPU" in m or "Third GPU" in m for m in messages), messages


def test_a_miss_takes_a_sibling_gpus_shipped_launch():
    """A bucket this GPU has no table entry for, nor a nearest one, takes the launch a shipped table
    of a sibling GPU (same compute capability and Triton, e.g. the H200's on an H100) holds for it
    or for its nearest bucket, before the planner's defaults; it says so in the miss warning. This
    GPU's own entry of the bucket comes first, the sibling's of the bucket before this GPU's nearest, and
    this GPU's nearest before the sibling's nearest; a user's table of the sibling is not taken."""
    call = linear_call()
    sibling = tuning.Machine("NVIDIA Sibling GPU", "9.0", "3.6.0")
    theirs = dataclasses.replace(default(call), BV=64, states_warps=8)
    tuning.record([entry(call, theirs), entry(linear_call(T=4096, K=64, V=64), theirs)], sibling, tuning.SHIPPED)
    with pytest.warns(UserWarning, match="using the launch tuned on a sibling GPU of the same compute capability"):
        chosen = resolve(call)
    assert chosen.launch == theirs and "sibling GPU" in chosen.source
    assert chosen.source.endswith(f"({tuning.SHIPPED / sibling.file_name()})")
    # its nearest bucket, held to the call as a nearest bucket of this GPU's would be
    with pytest.warns(UserWarning, match="for the nearest bucket, T 4096 B\\*H 64 K 64 V 64, on a sibling GPU"):
        near = resolve(linear_call(T=8192, K=64, V=64))
    assert near.launch == planner.fit_chunked(GDN, linear_call(K=64, V=64), torch.bfloat16, theirs)
    # off the sibling's buckets: the defaults
    with pytest.warns(UserWarning, match="using the defaults"):
        assert resolve(linear_call(K=256, V=256)).launch == default(linear_call(K=256, V=256))
    # this GPU's own entry of a nearest bucket: after the sibling's of the bucket; of the nearest buckets
    # the nearer, this GPU's on a tie
    ours = dataclasses.replace(default(call), BV=32)
    tuning.record([entry(linear_call(T=4096), ours)], FAKE, tuning.SHIPPED)
    assert resolve(call).launch == theirs
    with pytest.warns(UserWarning, match="using the nearest tuned bucket"):   # T 2048: 4096 is the nearer
        assert resolve(linear_call(T=2048)).launch == planner.fit_chunked(GDN, linear_call(T=2048), torch.bfloat16, ours)
    with pytest.warns(UserWarning, match="for the nearest bucket, T 8192 B\\*H 64 K 128 V 128, on a sibling GPU"):
        assert resolve(linear_call(T=16384)).launch == planner.fit_chunked(GDN, linear_call(T=16384), torch.bfloat16,
                                                                           theirs)
    # a nearest bucket's launch with the segments policy's (carried): theirs tuned one segment
    tuning.record([entry(linear_call(K=256, V=256, T=16384), dataclasses.replace(theirs, segments=1))], sibling,
                  tuning.SHIPPED)
    with pytest.warns(UserWarning, match="on a sibling GPU"):
        assert resolve(linear_call(B=2, K=256, V=256)).launch.segments == 0
    # and its own entry of the bucket first of all
    tuning.record([entry(call, ours)], FAKE, tuning.SHIPPED)
    assert resolve(call).launch == ours
    # a user's table of the sibling is another GPU's, not a shipped sibling's
    tuning.record([entry(linear_call(K=64, V=64, T=65536), theirs)], sibling)
    with pytest.warns(UserWarning) as got:
        assert resolve(linear_call(K=64, V=64, T=65536)).launch != theirs
    messages = [str(w.message) for w in got]
    assert any("ignoring the tuning table" in m for m in messages) and any("using the defaults" in m for m in messages)


def test_entries_of_another_versions_knobs_are_ignored_with_a_warning():
    """A user's table written before a knob was added (or after one was removed): its entries whose
    launch knobs are not this version's are left out with one warning naming the file and the fix,
    and the call takes what it would take without them; the table's other entries stand."""
    call, other = linear_call(), linear_call(T=4096)
    tuned = dataclasses.replace(default(call), stages=1)
    path = tuning.record([entry(call, tuned), entry(other, tuned)], FAKE)
    data = json.loads(path.read_text())
    old = next(row for row in data["entries"] if row["T"] == 8192)
    for knob in ("wu_warps", "bwd_wy_warps"):
        del old["launch"][knob]   # call's entry as an earlier attngen wrote it
    path.write_text(json.dumps(data))
    tuning._tables.cache_clear()
    table = tuning.read_table(path)
    assert (table.stale, len(table.entries)) == (1, 1)
    assert table.entries[0].key.bucket == tuning.bucket(other)
    with pytest.warns(UserWarning) as got:
        chosen = resolve(call)
    messages = [str(w.message) for w in got]
    assert any(f"ignoring 1 of the 2 entries of the tuning table {path}: their launch knobs are another attngen "
               "version's" in m and "`attngen tune`" in m for m in messages), messages
    # the call's bucket is a miss now: the nearest bucket, the entry left, with the miss's warning
    assert any("using the nearest tuned bucket" in m for m in messages), messages
    assert chosen.launch == resolve(other).launch == tuned


def test_an_entry_written_before_the_dq_and_dk_steps_had_warps_of_their_own_keeps_its_launch():
    """bwd_dq_warps and bwd_dk_warps came after tables were written, when bwd_warps launched those steps
    too (planner.ChunkedLaunch.INHERITED): an entry without them reads with each equal to its bwd_warps,
    the launch it was timed with, and is not stale; one that lacks another knob still is."""
    call = linear_call()
    tuned = dataclasses.replace(default(call), bwd_warps=8, bwd_dq_warps=8, bwd_dk_warps=8)
    path = tuning.record([entry(call, tuned)], FAKE)
    data = json.loads(path.read_text())
    for knob in ("bwd_dq_warps", "bwd_dk_warps"):
        del data["entries"][0]["launch"][knob]
    path.write_text(json.dumps(data))
    table = tuning.read_table(path)
    assert (table.stale, table.entries[0].launch) == (0, tuned)
    del data["entries"][0]["launch"]["bwd_wy_warps"]
    path.write_text(json.dumps(data))
    assert tuning.read_table(path).stale == 1


@pytest.mark.parametrize("name, family, knob", [("softmax_causal", "softmax", "dkdv_split"),
                                                ("gated_deltanet", "chunked", "segments")])
def test_an_entry_written_before_a_knob_keeps_the_launch_it_was_timed_with(name, family, knob):
    """Knobs that came after the shipped table's entries read, in an entry without them, as the value
    the entry was timed with (Launch.INHERITED takes a value as well as a knob's name): dkdv_split 0
    (dk and dv in one launch), segments 0 (the rule's segment policy). Such an entry is not stale;
    the shipped table has no stale entry."""
    spec = attngen.load_spec(SPECS / f"{name}.yaml")
    call = Call(4, 8192, 8192, 16, 128, 128, 128, 4, 8192, 0.1, False, 16)
    tuned = planner.default_launch(family, spec, call, torch.bfloat16, 132)
    path = tuning.record([entry(call, tuned, spec=spec, family=family)], FAKE)
    data = json.loads(path.read_text())
    del data["entries"][0]["launch"][knob]
    path.write_text(json.dumps(data))
    table = tuning.read_table(path)
    assert (table.stale, table.entries[0].launch) == (0, tuned)
    assert getattr(tuned, knob) == planner.LAUNCHES[family].INHERITED[knob] == 0
    shipped = tuning.read_table(next(Path(attngen.__file__).parent.glob("tables/*.json")))
    assert shipped.stale == 0 and any(e.key.kernel == family for e in shipped.entries)


@pytest.mark.parametrize("text, error", [
    ("{not json", "is not JSON"),
    ('{"entries": []}', "is not an attngen tuning table"),
    ('{"attngen_tuning_table": 1, "gpu": "x", "capability": "9.0", "triton": "3.6.0", "entries": {}}',
     "field 'entries' must be a list"),
    ("ENTRY", "entry 0: ChunkedLaunch.chunk: 48 is not allowed"),
    ("ENTRY-LAUNCH", "entry 0: launch: expected an object of the knobs chunk, BV"),
    ("ENTRY-T", "entry 0: T: expected a power of two, got 1000"),
])
def test_a_corrupt_table_is_an_error_naming_its_file(text, error):
    """A table that cannot be read, or an entry with a value no launch takes: an error naming the
    file, what is wrong, and what to do."""
    path = tuning.tune_dir() / "broken.json"
    path.parent.mkdir(parents=True)
    if text.startswith("ENTRY"):
        row = entry(linear_call(), default(linear_call())).to_json()
        if text == "ENTRY":
            row["launch"]["chunk"] = 48
        elif text == "ENTRY-LAUNCH":
            row["launch"] = list(row["launch"].values())
        else:
            row["T"] = 1000
        text = json.dumps({**tuning.Table(FAKE, ()).to_json(), "entries": [row]})
    path.write_text(text)
    with pytest.raises(tuning.TableError, match=f"tuning table {path}: .*{error}"):
        resolve(linear_call())


def test_autotune_searches_on_a_miss_only_when_asked(monkeypatch):
    call = linear_call()
    found = entry(call, dataclasses.replace(default(call), BV=64))
    monkeypatch.setenv("ATTNGEN_AUTOTUNE", "1")
    chosen = resolve(call, search=lambda: found)
    assert chosen.launch == found.launch and "ATTNGEN_AUTOTUNE" in chosen.source
    monkeypatch.setenv("ATTNGEN_AUTOTUNE", "yes")
    with pytest.raises(ValueError, match="ATTNGEN_AUTOTUNE: value 'yes' is not allowed"):
        resolve(call, search=no_search)


# --------------------------------------------------------------------------- the search
def test_search_descends_knob_by_knob_and_skips_failures():
    """A fake timer whose fastest launch is two knobs away from the default, with launches that
    'do not compile' on the way: the search finds it, reports every trial, and skips the failures."""
    call = linear_call()
    start = default(call)
    fit = lambda launch: planner.fit_chunked(GDN, call, torch.bfloat16, launch)  # noqa: E731
    measured = []

    def measure(launch, pass_):
        measured.append((launch, pass_))
        if launch.states_warps == 8:
            raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")
        if pass_ == "fwd":
            return 10 - (launch.chunk == 32) * 3 - (launch.BV == 64) * 2 + (launch.maxnreg != 255)
        return 5 - (launch.bwd_warps == 2) * 1.5

    lines = []
    found = tuning.search(start, fit, measure, report=lines.append)
    assert (found.best.chunk, found.best.BV, found.best.bwd_warps) == (32, 64, 2)
    assert found.best.states_warps == start.states_warps and found.best.maxnreg == 255
    assert found.default_ms == {"fwd": 10, "bwd": 5} and found.best_ms == {"fwd": 5, "bwd": 3.5}
    failed = [t for t in found.trials if t.error]
    assert failed and all("out of resource" in t.error and t.launch.states_warps == 8 for t in failed)
    assert any("skipped, RuntimeError: out of resource" in line for line in lines)
    # each launch timed once, but the best and the default, timed again in turn in each pass before the best
    # replaces the default (tuning.CONFIRM)
    again = [m for m in measured if measured.count(m) > 1]
    assert set(again) == {(launch, p) for launch in (start, found.best) for p in ("fwd", "bwd")}
    assert len(again) == 4 * (tuning.CONFIRM + 1)
    assert any(f"bwd: medians of {tuning.CONFIRM + 1} timings, the best 3.500 ms, the default 5.000 ms" in line
               for line in lines)


@pytest.mark.parametrize("outlier", ["default", "best"])
def test_one_far_off_timing_does_not_decide(outlier):
    """A launch timed once far off (the default too slow, or a candidate too fast) would pass for a gain
    over tuning.MIN_GAIN: the last pass's best and the default are timed again in turn and stand at the
    medians of their timings, where the two are equal, so the default stands."""
    call = linear_call()
    start = default(call)
    fit = lambda launch: planner.fit_chunked(GDN, call, torch.bfloat16, launch)  # noqa: E731
    other = fit(dataclasses.replace(start, chunk=32))
    timings = {start: [], other: []}

    def measure(launch, pass_):
        if pass_ == "fwd":
            return 1.0 if launch in (start, other) else 2.0
        timings.setdefault(launch, []).append(None)
        first = len(timings[launch]) == 1
        if first and launch == (start if outlier == "default" else other):
            return 4.4 if outlier == "default" else 3.6
        return 4.0 if launch in (start, other) else 5.0

    lines = []
    found = tuning.search(start, fit, measure, report=lines.append, seeds=(other,))
    assert found.best == start and found.best_ms["bwd"] == found.default_ms["bwd"] == 4.0
    assert len(timings[start]) == len(timings[other]) == tuning.CONFIRM + 1
    assert any("the default stands" in line for line in lines)


def test_search_moves_a_kernels_tile_and_warps_together(monkeypatch):
    """The dk/dv pass's fastest launch is 128 x 32 at eight warps, three knobs from the default, and every
    move of one knob alone is slower (a tile its warps do not hold spills): coordinate descent alone stops
    at the default; the search's joint move of the pass's tile and warps (SoftmaxLaunch.TILES) finds it,
    each launch timed once and prepared with the tile's others before it is timed."""
    call = Call(4, 8192, 8192, 16, 128, 128, 128, 4, 8192, 0.1, False, 16)
    start = planner.softmax_launch(call, torch.bfloat16, 132)
    start = dataclasses.replace(start, dkdv_BN=64, dkdv_BM=64, dkdv_warps=4)
    fit = lambda launch: planner.fit_launch("softmax", None, call, torch.bfloat16, launch)  # noqa: E731
    timed, prepared = [], set()

    def measure(launch, pass_):
        timed.append((launch, pass_))
        if pass_ == "fwd":
            return 1.0
        tile = (launch.dkdv_BN, launch.dkdv_BM, launch.dkdv_warps)
        return {(64, 64, 4): 10.0, (128, 32, 8): 7.0}.get(tile, 12.0)

    def prepare(launches, pass_):
        prepared.update((launch, pass_) for launch in launches)

    assert ("dkdv_BN", "dkdv_BM", "dkdv_warps", "dkdv_split", "dkdv_tma") in planner.SoftmaxLaunch.tiles("bwd")
    assert planner.SoftmaxLaunch.tiles("fwd") == (("BM", "BN", "warps"),)
    found = tuning.search(start, fit, measure, report=lambda line: None, prepare=prepare)
    assert (found.best.dkdv_BN, found.best.dkdv_BM, found.best.dkdv_warps) == (128, 32, 8)
    assert found.best_ms["bwd"] == 7.0 and found.default_ms["bwd"] == 10.0
    # each launch timed once, but the best and the default timed again in each pass before the best stands (CONFIRM)
    assert len(timed) == len(set(timed)) + 2 * 2 * tuning.CONFIRM
    firsts = {next(t for t in timed if t[1] == p) for p in ("fwd", "bwd")}
    assert all(t in prepared for t in timed if t not in firsts and t[0] != found.best), "timed unprepared"
    # without the joint moves the same timer leaves the default standing: no single knob's move gains
    monkeypatch.setattr(planner.SoftmaxLaunch, "TILES", ())
    assert tuning.search(start, fit, measure, report=lambda line: None).best == start


def test_search_prepares_each_knobs_launches_together_before_timing_them():
    """prepare() (tune's side-by-side compilation) receives a knob's untried launches at once,
    before any of them is timed, each launch once; the search finds what it finds without it."""
    call = linear_call()
    start = default(call)
    fit = lambda launch: planner.fit_chunked(GDN, call, torch.bfloat16, launch)  # noqa: E731
    events = []

    def measure(launch, pass_):
        events.append(("time", launch, pass_))
        return 10 - (launch.chunk == 32) * 3 if pass_ == "fwd" else 5 - (launch.bwd_warps == 2)

    def prepare(launches, pass_):
        events.append(("prepare", tuple(launches), pass_))

    found = tuning.search(start, fit, measure, report=lambda line: None, prepare=prepare)
    plain = tuning.search(start, fit, measure, report=lambda line: None)
    assert found.best == plain.best and (found.best.chunk, found.best.bwd_warps) == (32, 2)
    prepared = [(launch, pass_) for kind, launches, pass_ in events if kind == "prepare" for launch in launches]
    assert prepared and len(prepared) == len(set(prepared)), "a launch prepared twice in one pass"
    assert max(len(launches) for kind, launches, _ in events if kind == "prepare") >= 3, "not side by side"
    firsts = {pass_: next(x for k, x, p in events if k == "time" and p == pass_) for pass_ in ("fwd", "bwd")}
    first_bwd = next(i for i, (k, _, p) in enumerate(events) if p == "bwd")
    for i, (kind, launch, pass_) in enumerate(events):
        final = pass_ == "fwd" and i > first_bwd   # the final launch's forward, timed again
        if (kind == "time" and launch != firsts[pass_] and not final
                and not (pass_ == "bwd" and launch == found_fwd_best(events))):
            # every launch a knob tries is timed after the prepare() that named it, in its pass
            assert any(k == "prepare" and launch in ls and p == pass_ for k, ls, p in events[:i]), launch


def found_fwd_best(events):
    """The bwd pass starts by timing the forward's best (no prepare: one launch)."""
    bwd = [x for k, x, p in events if k == "time" and p == "bwd"]
    return bwd[1] if len(bwd) > 1 else None


def test_search_stops_at_an_illegal_address():
    """A launch that loses the CUDA context (an illegal address: every later kernel would fail)
    stops the search with an error naming it and the hazard, instead of skipping it and reporting
    every later launch as failed."""
    call = linear_call()
    measured = []

    def measure(launch, pass_):
        measured.append(launch)
        if launch.chunk == 32:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return 1.0

    lines = []
    with pytest.raises(RuntimeError, match="illegal address .* CUDA context unusable: the search stops"):
        tuning.search(default(call), lambda launch: planner.fit_chunked(GDN, call, torch.bfloat16, launch), measure,
                      report=lines.append)
    assert measured[-1].chunk == 32 and len(measured) == 3
    assert "illegal memory access" in lines[-1]


def test_search_stops_when_its_budget_is_spent():
    call = linear_call()
    lines = []
    found = tuning.search(default(call), lambda launch: planner.fit_chunked(GDN, call, torch.bfloat16, launch),
                          lambda launch, pass_: 1.0, report=lines.append, budget_s=0)
    assert found.best == default(call) and [t.launch for t in found.trials] == [default(call)] * 2
    assert "  fwd: its share of the budget of 0 s is spent" in lines and "  bwd: its share of the budget of 0 s is spent" in lines


@pytest.mark.usefixtures("triton_backend")
def test_tune_on_the_interpreter_writes_a_table_the_runtime_then_hits(monkeypatch):
    """`tune` end to end through the generated module on Triton's interpreter (a fake machine and
    timer): the timer's winner is written, a launch whose outputs differ is rejected, and a
    lookup of that shape then returns the winner without a search."""
    spec = attngen.load_spec(SPECS / "mamba2.yaml")
    module = codegen.load_module(spec)
    real_op, launches = module.op, []

    def op(*args):
        launches.append(args[10])
        o, *rest = real_op(*args)
        return (o * 2 if args[10][:2] == [16, 16] else o), *rest    # chunk 16 with BV 16: wrong outputs

    def timer(fn):
        fn()
        return 1.0 if launches[-1][0] == 32 else 2.0   # the forward of the launch timed, or its backward's

    monkeypatch.setattr(module, "op", op)
    lines = []
    shape = Shape(batch=1, q_len=40, heads=2, head_dim=16, value_dim=16)
    (got,) = tuning.tune(spec, [shape], torch.float32, "cpu", mach=FAKE, timer=timer, report=lines.append)
    assert got.launch.chunk == 32 and got.ms["fwd"] == 1.0 and got.default_ms["fwd"] == 2.0
    assert any("chunk=16" in line and "outputs differ from the default launch's" in line for line in lines), lines
    table = tuning.read_table(tuning.tune_dir() / FAKE.file_name())
    assert [e.launch for e in table.entries] == [got.launch]
    call = Call(1, 40, 40, 2, 16, 16, 16, 1, 40, 0.25, False, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = tuning.resolve(spec, "chunked", call, torch.float32, FAKE,
                                planner.chunked_launch(spec, call, torch.float32), search=no_search)
    assert chosen.launch == got.launch


def test_tune_writes_each_shape_once_searched(monkeypatch):
    """A shape's winner is in the table as soon as its search ends: a later shape's failure (on a GPU,
    an illegal address ends the process's CUDA context) keeps it."""
    spec = attngen.load_spec(SPECS / "mamba2.yaml")
    shapes = [Shape(batch=1, q_len=40, heads=2, head_dim=16, value_dim=16),
              Shape(batch=1, q_len=40, heads=2, head_dim=32, value_dim=32)]
    searched = []

    def search(default, fit, measure, passes, report, budget_s=None, prepare=None, seeds=()):
        searched.append(default)
        if len(searched) == 2:
            raise RuntimeError("an illegal memory access was encountered")
        return tuning.Found(default, (), {p: 2.0 for p in passes}, {p: 1.0 for p in passes})

    monkeypatch.setattr(tuning, "search", search)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        tuning.tune(spec, shapes, torch.float32, "cpu", mach=FAKE, report=lambda line: None)
    table = tuning.read_table(tuning.tune_dir() / FAKE.file_name())
    assert [e.shape for e in table.entries] == ["1,40,2,16,16"] and table.entries[0].launch == searched[0]


def test_tune_at_a_decode_shape_times_the_forward_alone():
    """A softmax decode shape (one query against a longer cache of keys): a decode step runs no
    backward, so the search times the forward only and the entry keeps the default's backward knobs."""
    spec = attngen.load_spec(SPECS / "softmax_causal.yaml")
    shape = Shape(batch=1, q_len=1, k_len=64, heads=2, head_dim=16, value_dim=16)
    (got,) = tuning.tune(spec, [shape], torch.float32, "cpu", mach=FAKE, timer=lambda fn: (fn(), 1.0)[1],
                         report=lambda line: None, budget_s=5)
    assert set(got.ms) == {"fwd"} and got.key.bucket == tuning.Bucket(16, 64, 2, 16, 16)


@pytest.mark.parametrize("q_len,k_len,timer", [(1, 64, "do_bench_graph"), (40, None, "do_bench")])
def test_a_decode_shape_is_timed_from_a_cuda_graph(monkeypatch, q_len, k_len, timer):
    """Without a timer of the caller's, a decode shape's launches are timed replayed from a CUDA graph
    (at a few sequences the host's launch cost outlasts the kernels), others by do_bench."""
    used = []
    for name in ("do_bench", "do_bench_graph"):
        monkeypatch.setattr(tuning, name, lambda fn, name=name: (fn(), used.append(name), 1.0)[2])
    spec = attngen.load_spec(SPECS / "softmax_causal.yaml")
    shape = Shape(batch=1, q_len=q_len, k_len=k_len, heads=2, head_dim=16, value_dim=16)
    tuning.tune(spec, [shape], torch.float32, "cpu", mach=FAKE, report=lambda line: None, budget_s=0)
    assert used and set(used) == {timer}


def test_do_bench_graph_falls_back_where_capture_fails(monkeypatch):
    import triton.testing

    def no_capture(fn, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", no_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(tuning, "do_bench", lambda fn: 3.0)
    assert tuning.do_bench_graph(lambda: None) == 3.0


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("name", ["softmax_causal", "forgetting_attention"])
def test_a_decode_shape_runs_the_serving_call_on_a_cache(monkeypatch, name):
    """A softmax decode shape is searched through the serving call (the append, the split forward on
    the cache's rows, the merge: the kernels a decode step runs), on a cache of Tk rows whose first
    Tk - Tq keys are the shape's: the same outputs as the forward over all Tk keys (causal; the cache's
    log decays are zero, so forgetting attention's only where the inputs' are), the same at every call."""
    spec = attngen.load_spec(SPECS / f"{name}.yaml")
    op = attngen.Op(spec)
    module = codegen.load_module(spec)
    shape = Shape(batch=2, q_len=3, k_len=40, heads=2, head_dim=16, value_dim=16)
    inputs = bench_inputs(spec, shape, torch.float32, "cpu")
    if spec.decay == "scalar":
        inputs["g"] = torch.zeros_like(inputs["g"])
    call = runtime.check_call(op, inputs)
    launch = planner.default_launch("softmax", spec, call, torch.float32, SMS)
    cached_calls = []
    real = module.cached_op
    monkeypatch.setattr(module, "cached_op", lambda *a: (cached_calls.append(1), real(*a))[1])
    run = tuning._cached_runner(op, module, inputs, call)
    (o,) = run(launch, "fwd")
    (again,) = run(launch, "fwd")
    (full,) = tuning._runner(op, module, inputs, call)(launch, "fwd")
    assert len(cached_calls) == 2 and run.args is None
    torch.testing.assert_close(o, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, o, rtol=0, atol=0)


def test_no_serving_runner_for_a_sliding_window_or_a_linear_spec():
    for name, k_len in (("sliding_window", 40), ("gated_deltanet", None)):
        spec = attngen.load_spec(SPECS / f"{name}.yaml")
        op = attngen.Op(spec)
        inputs = bench_inputs(spec, Shape(batch=1, q_len=1, k_len=k_len, heads=2, head_dim=16, value_dim=16),
                              torch.float32, "cpu")
        assert tuning._cached_runner(op, codegen.load_module(spec), inputs, runtime.check_call(op, inputs)) is None


@pytest.mark.parametrize("budget", [-1, float("nan"), float("inf"), "10", True])
def test_a_bad_budget_is_a_clear_error(budget):
    spec = attngen.load_spec(SPECS / "mamba2.yaml")
    with pytest.raises(ValueError, match=r"budget_s: expected seconds, a finite number >= 0, or None; got"):
        tuning.tune(spec, [Shape(batch=1, q_len=40, heads=2, head_dim=16, value_dim=16)], torch.float32, "cpu",
                    mach=FAKE, report=lambda line: None, budget_s=budget)


def test_a_warning_names_the_first_line_outside_attngen():
    # two frames of attngen's own between the warning and the caller, as choose -> resolve has
    inside = str(Path(tuning.__file__).parent / "calls.py")
    ns = {"tuning": tuning}
    exec(compile("def outer():\n    inner()\n\ndef inner():\n    tuning._warn_once('test', 'attngen: a test')\n",
                 inside, "exec"), ns)
    with pytest.warns(UserWarning, match="a test") as got:
        ns["outer"]()
    assert got[0].filename == __file__


def test_the_budget_is_shared_by_the_passes(monkeypatch):
    """A budget of 12 launch-seconds: the forward's knobs (many) cannot take it all; the backward's
    share is what the forward left (a fake clock: one second per timed launch)."""
    call = linear_call()
    clock = [0.0]
    monkeypatch.setattr(tuning.time, "monotonic", lambda: clock[0])

    def measure(launch, pass_):
        clock[0] += 1.0
        return 1.0

    found = tuning.search(default(call), lambda launch: planner.fit_chunked(GDN, call, torch.bfloat16, launch),
                          measure, report=lambda line: None, budget_s=12)
    per_pass = {p: sum(t.pass_ == p for t in found.trials) for p in ("fwd", "bwd")}
    assert 5 <= per_pass["fwd"] <= 8 and per_pass["bwd"] >= 5, per_pass


def test_a_knob_started_is_timed_even_when_its_compilation_outlasts_the_share(monkeypatch):
    """The first knob's compilation (prepare) takes longer than the pass's share of the budget (K = V =
    256): its launches are still timed, so a faster chunk is found; no later knob is started."""
    call = linear_call()
    clock = [0.0]
    monkeypatch.setattr(tuning.time, "monotonic", lambda: clock[0])

    def prepare(launches, pass_):
        clock[0] += 100.0

    def measure(launch, pass_):
        return 1.0 if launch.chunk == 32 else 2.5

    found = tuning.search(default(call), lambda launch: planner.fit_chunked(GDN, call, torch.bfloat16, launch),
                          measure, ("fwd",), report=lambda line: None, budget_s=20, prepare=prepare)
    assert found.best.chunk == 32 and found.best_ms["fwd"] == 1.0
    assert {t.launch.chunk for t in found.trials} == {16, 32, 64} and all(t.launch.BV == default(call).BV
                                                                            for t in found.trials)


@pytest.mark.parametrize("seed_ms,expected_chunk", [(0.5, 16), (3.0, 32)])
def test_a_seed_faster_than_the_search_is_its_best(seed_ms, expected_chunk):
    """The table's entry being searched again is timed in each pass beside the default: where it is
    faster than anything the knobs reach it is the best (a search never ends slower than the entry it
    replaces); where slower, the search's best stands."""
    call = linear_call()
    seed = dataclasses.replace(default(call), chunk=16, BV=16)
    fit = lambda launch: planner.fit_chunked(GDN, call, torch.bfloat16, launch)  # noqa: E731

    def measure(launch, pass_):
        return seed_ms if launch == fit(seed) else (1.0 if launch.chunk == 32 else 2.0)

    found = tuning.search(default(call), fit, measure, ("fwd",), report=lambda line: None, seeds=(seed,))
    assert found.best.chunk == expected_chunk and (found.best == fit(seed)) == (seed_ms < 1.0)
    assert sum(t.launch == fit(seed) for t in found.trials if not t.again) == 1


def test_a_seeds_backward_knobs_are_timed_over_the_forwards_best():
    """A seed that wins the backward pass as a whole would drop the forward knobs the forward's pass found
    (chunk, a knob the backward's pass does not move): its backward knobs are also timed over the
    forward's best, and that launch is the search's best. The backward's gain needs two of its knobs at
    once, which no single move reaches."""
    call = linear_call()
    fit = lambda launch: planner.fit_chunked(GDN, call, torch.bfloat16, launch)  # noqa: E731
    start = default(call)
    assert (start.chunk, start.bwd_stages, start.bwd_ds_stages) == (64, 3, 3)
    seed = dataclasses.replace(start, bwd_stages=1, bwd_ds_stages=2)

    def measure(launch, pass_):
        fwd = 1.0 if launch.chunk == 32 else 2.0
        return fwd if pass_ == "fwd" else fwd + (0.5 if (launch.bwd_stages, launch.bwd_ds_stages) == (1, 2) else 3.0)

    lines = []
    found = tuning.search(start, fit, measure, report=lines.append, seeds=(seed,))
    crossed = fit(dataclasses.replace(start, chunk=32, bwd_stages=1, bwd_ds_stages=2))
    assert found.best == crossed and found.best_ms == {"fwd": 1.0, "bwd": 1.5}
    assert any("bwd [seed's bwd knobs] chunk=32 bwd_stages=1 bwd_ds_stages=2: 1.500 ms" in line for line in lines)
    assert sum(t.launch == crossed and t.pass_ == "bwd" for t in found.trials if not t.again) == 1
    # one pass alone: no seed is crossed
    only = tuning.search(start, fit, measure, ("fwd",), report=lambda line: None, seeds=(seed,))
    assert crossed not in {t.launch for t in only.trials}


def test_tune_seeds_the_search_with_the_entry_it_replaces_and_the_nearest(monkeypatch, tmp_path):
    spec = attngen.load_spec(SPECS / "mamba2.yaml")
    shape = Shape(batch=1, q_len=40, heads=2, head_dim=16, value_dim=16)
    seeds = []

    def search(default, fit, measure, passes, report, budget_s=None, prepare=None, **kw):
        seeds.append(kw.get("seeds", ()))
        return tuning.Found(dataclasses.replace(default, chunk=16), (), {p: 2.0 for p in passes},
                            {p: 1.0 for p in passes})

    monkeypatch.setattr(tuning, "search", search)
    tuning.tune(spec, [shape], torch.float32, "cpu", mach=FAKE, report=lambda line: None, directory=tmp_path)
    tuning.tune(spec, [shape], torch.float32, "cpu", mach=FAKE, report=lambda line: None, directory=tmp_path)
    assert seeds[0] == () and [s.chunk for s in seeds[1]] == [16]
    # another shape of the same head dims within the nearest-bucket range: the nearest entry's launch
    # (what the runtime takes there without an entry), which a search also times
    tuning.tune(spec, [Shape(batch=1, q_len=100, heads=2, head_dim=16, value_dim=16)], torch.float32, "cpu",
                mach=FAKE, report=lambda line: None, directory=tmp_path)
    assert [s.chunk for s in seeds[2]] == [16]
    # other head dims: none
    tuning.tune(spec, [Shape(batch=1, q_len=40, heads=2, head_dim=32, value_dim=32)], torch.float32, "cpu",
                mach=FAKE, report=lambda line: None, directory=tmp_path)
    assert seeds[3] == ()
    # a sibling GPU's shipped launch where this GPU has no entry (what the runtime takes then)
    wide = Shape(batch=1, q_len=40, heads=2, head_dim=64, value_dim=64)
    wide_call = Call(1, 40, 40, 2, 64, 64, 64, 1, 40, 64 ** -0.5, False, 2)
    theirs = dataclasses.replace(planner.chunked_launch(spec, wide_call, torch.float32), chunk=32)
    tuning.record([entry(wide_call, theirs, spec=spec, dtype=torch.float32)],
                  dataclasses.replace(FAKE, gpu="NVIDIA Sibling GPU"), tuning.SHIPPED)
    tuning.tune(spec, [wide], torch.float32, "cpu", mach=FAKE, report=lambda line: None, directory=tmp_path)
    assert seeds[4] == (theirs,)
    # a table it cannot read holds no seed (writing the entry then reports the table's error)
    (tmp_path / FAKE.file_name()).write_text("not json")
    assert tuning._seeds(tmp_path, FAKE, tuning.Key("chunked", "0", "float32", tuning.Bucket(64, 64, 2, 16, 16))) == ()


def test_tune_times_the_launches_given_as_seeds_first(monkeypatch, tmp_path):
    """`attngen tune --seed knob=value,...`: launches over each shape's default the search times at its
    start, before the table's; a knob of another launch family is a clear error naming it."""
    spec = attngen.load_spec(SPECS / "mamba2.yaml")
    shape = Shape(batch=1, q_len=40, heads=2, head_dim=16, value_dim=16)
    seeds = []

    def search(default, fit, measure, passes, report, budget_s=None, prepare=None, **kw):
        seeds.append(kw["seeds"])
        return tuning.Found(default, (), {p: 1.0 for p in passes}, {p: 1.0 for p in passes})

    monkeypatch.setattr(tuning, "search", search)
    tuning.tune(spec, [shape], torch.float32, "cpu", mach=FAKE, report=lambda line: None, directory=tmp_path,
                seeds=({"bwd_warps": 8}, {"output_warps": 2, "segments": 4}))
    tuning.tune(spec, [shape], torch.float32, "cpu", mach=FAKE, report=lambda line: None, directory=tmp_path,
                seeds=({"bwd_warps": 8},))
    (given, other), (again, entry_) = seeds
    assert given.bwd_warps == 8 and (other.output_warps, other.segments) == (2, 4)
    assert dataclasses.replace(given, bwd_warps=other.bwd_warps, output_warps=2, segments=4) == other
    assert again == given and entry_ != given
    with pytest.raises(ValueError, match="seeds: dq_BM is no ChunkedLaunch knob .*'mamba2'"):
        tuning.tune(spec, [shape], torch.float32, "cpu", mach=FAKE, directory=tmp_path, seeds=({"dq_BM": 64},))
    with pytest.raises(ValueError, match="ChunkedLaunch.bwd_warps: 3 is not allowed"):
        tuning.tune(spec, [shape], torch.float32, "cpu", mach=FAKE, directory=tmp_path, seeds=({"bwd_warps": 3},))


@pytest.mark.parametrize("fwd_at_32, bwd_at_32", [(9.0, 20.1), (9.0, 21.0), (9.9, 19.9)])
def test_a_forward_gain_that_slows_the_training_step_does_not_stand(fwd_at_32, bwd_at_32):
    """The forward pass finds a faster chunk whose forward + backward is slower than the default's, or
    whose gains in both are within the timing noise (tuning.MIN_GAIN), and no backward knob does better:
    the default stands, with its times."""
    call = linear_call()
    start = default(call)
    fit = lambda launch: planner.fit_chunked(GDN, call, torch.bfloat16, launch)  # noqa: E731

    def measure(launch, pass_):
        if pass_ == "fwd":
            return fwd_at_32 if launch.chunk == 32 else 10.0
        return bwd_at_32 if launch.chunk == 32 else 20.0

    lines = []
    found = tuning.search(start, fit, measure, report=lines.append)
    assert found.best == start and found.best_ms == found.default_ms == {"fwd": 10.0, "bwd": 20.0}
    assert any("is not 2% faster than the default (20.000 ms), nor 2% faster in fwd and as fast in bwd: "
               "the default stands" in line for line in lines), lines
    assert not tuning.stands({"fwd": fwd_at_32, "bwd": bwd_at_32}, {"fwd": 10.0, "bwd": 20.0}, ("fwd", "bwd"))


def test_a_forward_gain_at_no_cost_to_the_training_step_stands():
    """The forward pass finds a launch 10% faster whose forward + backward is as fast as the default's
    (faster by less than tuning.MIN_GAIN): it stands, a prefill's gain that costs training nothing
    (softmax_causal B1 T32768 on an H100: 8.071 against 8.472 ms forward, 37.093 against 37.672 forward +
    backward, where the default stood before)."""
    call = linear_call()
    start = default(call)
    fit = lambda launch: planner.fit_chunked(GDN, call, torch.bfloat16, launch)  # noqa: E731

    def measure(launch, pass_):
        return (9.0 if launch.chunk == 32 else 10.0) if pass_ == "fwd" else (19.9 if launch.chunk == 32 else 20.0)

    lines = []
    found = tuning.search(start, fit, measure, report=lines.append)
    assert found.best.chunk == 32 and found.best_ms == {"fwd": 9.0, "bwd": 19.9}
    assert found.default_ms == {"fwd": 10.0, "bwd": 20.0}
    assert not any("the default stands" in line for line in lines), lines
    assert tuning.stands(found.best_ms, found.default_ms, ("fwd", "bwd"))
    # the forward alone (a decode search): its one pass decides
    assert tuning.stands({"fwd": 9.0}, {"fwd": 10.0}, ("fwd",))
    assert not tuning.stands({"fwd": 9.9}, {"fwd": 10.0}, ("fwd",))


# dims of each input, in order
_LAYOUT = {("q", 4): "BTHK", ("k", 4): "BTHK", ("v", 4): "BTHV", ("g", 1): "H", ("g", 3): "BTH", ("g", 4): "BTHK",
           ("beta", 3): "BTH"}


@pytest.mark.parametrize("path", sorted(tuning.SHIPPED.glob("*.json")), ids=lambda p: p.name)
def test_shipped_tables_are_current(path):
    """Each shipped table reads; every entry is for a shipped spec as it is now (an entry of an
    edited spec would never be hit: its hash changed), at the bucket of its shape, and holds a
    launch the planner's fit leaves as it is (a table cannot bypass a clamp of planner.fit_launch)."""
    from attngen.testing import parse_shape
    from specs import SHIPPED

    table = tuning.read_table(path)
    assert path.name == table.machine.file_name()
    assert table.entries and not table.stale
    for entry in table.entries:
        assert entry.spec in SHIPPED, entry.spec
        spec = attngen.load_spec(SHIPPED[entry.spec])
        assert entry.key.spec_hash == spec.hash, f"{entry.spec}: the entry is for another version of the spec"
        assert entry.key.kernel == planner.launch_family(spec)
        # the call of the entry's shape, checked as a call is (on empty tensors of the meta device)
        small = random_inputs(spec, Shape(batch=1, q_len=2, heads=1, head_dim=2, value_dim=2), seed=0)
        shape = parse_shape(entry.shape)
        sizes = {"B": shape.batch, "T": shape.q_len, "H": shape.heads, "K": shape.head_dim, "V": shape.value_dim}
        # a decode shape's keys and values (and decays) are longer than its queries
        keys = dict(sizes, T=shape.k_len or shape.q_len)
        inputs = {n: torch.empty(*[(sizes if n == "q" else keys)[d] for d in _LAYOUT[n, t.dim()]],
                                 dtype=torch.bfloat16 if n in "qkv" else t.dtype, device="meta")
                  for n, t in small.items() if (n, getattr(t, "ndim", 0)) in _LAYOUT}
        call = runtime.check_call(attngen.load(spec), inputs)
        assert entry.key.bucket == tuning.bucket(call), entry.spec
        dtype = getattr(torch, entry.key.dtype)
        assert planner.fit_launch(entry.key.kernel, spec, call, dtype, entry.launch) == entry.launch, entry.spec
        assert all(ms is not None for ms in entry.ms.values()), entry.spec
        # a launch other than the default stands only MIN_GAIN faster in the last pass, or in the forward and
        # no slower in the last (tuning.stands)
        passes = tuple(p for p in ("fwd", "bwd") if p in entry.ms)
        assert entry.ms == entry.default_ms or tuning.stands(entry.ms, entry.default_ms, passes), entry.spec
