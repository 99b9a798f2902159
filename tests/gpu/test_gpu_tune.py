"""Tuning on the GPU (compiled mode): `attngen tune` on one spec at one shape finishes and writes
its table; a fresh process then takes that launch from the table with no search and no miss
warning; a tuned launch and the default give the same outputs and gradients.

Run on a CUDA machine: bash gpu.sh tests/gpu/<this file>
"""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attngen
from attngen import codegen, planner, tuning
from attngen.testing import LOWP_FACTOR, LOWP_FLOOR, bench_inputs, kernel_launch, parse_shape, rel_error

ROOT = Path(__file__).resolve().parents[2]
SHAPE = "2,1024,4,64,64"

# In a fresh process: the launch of a call at SHAPE, where it came from, and that no search ran.
FRESH = '''
import json, sys, warnings
import torch
import attngen
from attngen import planner, tuning
from attngen.testing import bench_inputs, parse_shape
def no_search(*args, **kwargs):
    raise SystemExit("a search ran")
tuning.tune = no_search
spec = attngen.load_spec(sys.argv[1])
op = attngen.load(spec)
inputs = bench_inputs(spec, parse_shape(sys.argv[2]), torch.bfloat16, "cuda")
with warnings.catch_warnings():
    warnings.filterwarnings("error", message="attngen")
    call = attngen.runtime.check_call(op, inputs)
    chosen = tuning.choose(spec, planner.launch_family(spec), call, torch.bfloat16, "cuda")
    out = op(**inputs)
torch.cuda.synchronize()
print(json.dumps({"launch": chosen.launch.ints(), "source": chosen.source}))
'''


@pytest.mark.parametrize("name", ["mamba2", "softmax_causal"])
def test_tune_then_a_fresh_process_takes_the_table(name, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ATTNGEN_TUNE_DIR": str(tmp_path), "ATTNGEN_AUTOTUNE": "1"}
    spec = ROOT / "specs" / f"{name}.yaml"
    out = subprocess.run([sys.executable, "-m", "attngen.cli", "tune", str(spec), "--shapes", SHAPE, "--dtype",
                          "bfloat16", "--budget", "40"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (table,) = tmp_path.glob("*.json")
    (entry,) = tuning.read_table(table).entries
    assert entry.key.spec_hash == attngen.load_spec(spec).hash and entry.ms["fwd"] is not None
    fresh = subprocess.run([sys.executable, "-c", FRESH, str(spec), SHAPE], capture_output=True, text=True,
                           cwd=ROOT, env=env, timeout=200)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    got = json.loads(fresh.stdout.strip().splitlines()[-1])
    assert got["source"] == f"tuned ({table})", got
    assert got["launch"] == entry.launch.ints()


@pytest.mark.parametrize("name", ["gated_deltanet", "kda", "gla", "softmax_causal", "forgetting_attention"])
def test_tuned_and_default_launches_agree(name):
    """A launch other than the default on every knob the search moves first (chunk / tiles, warps,
    stages; the backward's; the delta rules' UT step split or fused and its backward's warps) gives
    the default's outputs and gradients, to the rounding of the dtype: a miscompiled launch would not."""
    op = attngen.load(ROOT / "specs" / f"{name}.yaml")
    module = codegen.load_module(op.spec)
    inputs = bench_inputs(op.spec, parse_shape("2,1000,4,128,128"), torch.bfloat16, "cuda")
    form, ints = kernel_launch(op, inputs)
    family = planner.launch_family(op.spec)
    default = planner.LAUNCHES[family](*ints)
    call = attngen.runtime.check_call(op, inputs)
    if family == "chunked":
        other = dataclasses.replace(default, chunk=32, BV=64, states_BV=32, states_warps=2, output_BV=64,
                                    output_warps=2, stages=2, bwd_chunk=16, bwd_warps=2, bwd_states_BV=32,
                                    wu_warps=0 if default.wu_warps else 4,
                                    bwd_wy_warps=8 if default.bwd_wy_warps == 4 else 4)
    else:
        other = dataclasses.replace(default, BM=128, BN=32, warps=8, stages=2, last_first=0, dq_BM=64, dq_BN=64,
                                    dkdv_BN=128, dkdv_BM=32, dkdv_warps=8)
    other = planner.fit_launch(family, op.spec, call, torch.bfloat16, other)
    assert other != default
    run = tuning._runner(op, module, inputs, call)
    tol = LOWP_FACTOR * LOWP_FLOOR[torch.bfloat16]
    for pass_ in ("fwd", "bwd"):
        want, got = run(default, pass_), run(other, pass_)
        for i, (a, b) in enumerate(zip(got, want)):
            assert rel_error(a, b) <= tol, f"{pass_} result {i}: {rel_error(a, b):.2e} > {tol:.2e}"



@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("name", ["softmax_causal", "forgetting_attention"])
def test_the_backward_passes_launch_variants_agree(name, d):
    """The dk/dv pass in two launches (dkdv_split), and the backward passes' masked tiles by pointers under
    the copy engine's unmasked ones (dq_tma, dkdv_tma 2), alone and together, at tiles each makes room for
    (K = V = 256: 64 x 64 at eight warps, where the defaults' launches spill), give the default's gradients
    to the rounding of the dtype, on sequences that end mid-tile (dense, and packed)."""
    op = attngen.load(ROOT / "specs" / f"{name}.yaml")
    module = codegen.load_module(op.spec)
    tol = LOWP_FACTOR * LOWP_FLOOR[torch.bfloat16]
    for cu in (None, (0, 37, 500, 1000)):
        inputs = bench_inputs(op.spec, parse_shape(f"{2 if cu is None else 1},1000,4,{d},{d}"), torch.bfloat16, "cuda")
        if cu is not None:
            inputs["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device="cuda")
        q, k, v, g, cu_seqlens = (inputs.get(n) for n in ("q", "k", "v", "g", "cu_seqlens"))
        scale = op.spec.default_scale(d)
        default = planner.SoftmaxLaunch(*kernel_launch(op, inputs)[1])
        o, lse = module.forward(q, k, v, g, cu_seqlens, scale, None, default.ints())
        do = torch.randn_like(o)
        want = module.backward(q, k, v, g, cu_seqlens, scale, None, default.ints(), o, lse, do, None)
        call = attngen.runtime.check_call(op, inputs)
        for split, tma in ((1, default.dkdv_tma), (0, 2), (1, 2)):
            other = dataclasses.replace(default, dkdv_split=split, dq_tma=tma, dkdv_tma=tma, dq_BM=64, dq_BN=64 if tma == 2 else 32,
                                        dq_warps=8, dkdv_BN=64, dkdv_BM=64 if split else 32, dkdv_warps=8)
            other = planner.fit_launch("softmax", op.spec, call, torch.bfloat16, other)
            got = module.backward(q, k, v, g, cu_seqlens, scale, None, other.ints(), o, lse, do, None)
            for i, (a, b) in enumerate(zip(got, want)):
                if a is not None:
                    err = rel_error(a, b)
                    assert err <= tol, f"cu_seqlens {cu} {other.describe()} gradient {i}: {err:.2e} > {tol:.2e}"
