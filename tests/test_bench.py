"""`attngen bench`'s pieces that need no GPU: the baseline picked from a spec's semantics (user
specs too), shapes as the command line writes them, the FLOP counts, the --plot sweep."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import attngen
from attngen import bench
from attngen.testing import Shape, format_shape, parse_shape

SPECS = Path(__file__).resolve().parents[1] / "specs"
DENSE = Shape(batch=4, q_len=8192, heads=16, head_dim=128, value_dim=128)


def _bench_script(name: str):
    """bench/<name>.py, a script not a package module, loaded as a module."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


BASELINE_NAMES = {
    "gated_deltanet": ["fla chunk_gated_delta_rule"],
    "deltanet": ["fla chunk_delta_rule"],
    "kda": ["fla chunk_kda"],
    "mamba2": ["fla chunk_simple_gla"],
    "retnet": ["fla chunk_simple_gla g_gamma"],
    "gla": ["fla chunk_gla"],
    "linear_transformer": ["fla chunk_linear_attn + elu+1 in torch"],
    "performer": [],
    "performer_bidirectional": [],
    "linear_bidirectional": [],
    "softmax_causal": ["SDPA causal", "FlexAttention causal"],
    "softmax_bidirectional": ["SDPA", "FlexAttention no mask"],
    "sliding_window": ["FlexAttention window 1024"],
    "forgetting_attention": ["fla parallel_forgetting_attn", "FlexAttention causal + decay score_mod"],
}


@pytest.mark.parametrize("name", sorted(BASELINE_NAMES))
def test_the_baseline_follows_the_semantics(name):
    spec = attngen.load_spec(SPECS / f"{name}.yaml")
    assert [b.name for b in bench.baselines(spec, DENSE, 0.1, "cpu")] == BASELINE_NAMES[name]


def test_user_specs_get_the_baseline_of_their_semantics():
    """A user spec whose semantics a baseline computes gets it, whatever its name; one that no
    baseline computes (another feature map, l2 norm with the additive rule) runs attngen alone;
    --vs narrows the choice; decode (Tq 1) sees every key, SDPA without its top-left causal mask."""
    linear = attngen.load_spec({"name": "mine", "attention": "linear"})
    assert [b.name for b in bench.baselines(linear, DENSE, 0.1, "cpu")] == ["fla chunk_linear_attn"]
    for other in ({"feature_map": "relu"}, {"qk_norm": "l2"}, {"feature_map": {"expr": "x**2"}}):
        spec = attngen.load_spec({"name": "mine", "attention": "linear", **other})
        assert bench.baselines(spec, DENSE, 0.1, "cpu") == [], other
    causal = attngen.load_spec(SPECS / "softmax_causal.yaml")
    assert [b.name for b in bench.baselines(causal, DENSE, 0.1, "cpu", ("flex",))] == ["FlexAttention causal"]
    decode = parse_shape("4,8192,16,128,128,1")
    assert [b.name for b in bench.baselines(causal, decode, 0.1, "cpu", ("sdpa",))] == ["SDPA"]
    prefill = parse_shape("1,8192,16,128,128,4096")
    assert [b.name for b in bench.baselines(causal, prefill, 0.1, "cpu")] == ["FlexAttention causal"]
    # the forgetting decay: fla's op takes queries and keys alike (no end-aligned Tq < Tk) and a window
    forgetting = attngen.load_spec(SPECS / "forgetting_attention.yaml")
    assert [b.name for b in bench.baselines(forgetting, prefill, 0.1, "cpu")] == [
        "FlexAttention causal + decay score_mod"]
    windowed = attngen.load_spec({"name": "mine", "attention": "softmax", "mask": "sliding_window", "window": 64,
                                  "decay": "scalar"})
    assert [b.name for b in bench.baselines(windowed, DENSE, 0.1, "cpu", ("fla",))] == ["fla parallel_forgetting_attn"]


def test_shapes_parse_and_print_back():
    for text in ("4,8192,16,128,128", "4,8192,16,128,128,1", "1,4096,32,64,64,4096,8"):
        assert format_shape(parse_shape(text)) == text
    gqa = parse_shape("1,4096,32,64,64,4096,8")
    assert (gqa.q_len, gqa.k_len, gqa.heads, gqa.kv_heads) == (4096, None, 32, 8)
    with pytest.raises(ValueError, match="expected B,T,H,K,V"):
        parse_shape("4,x,16,128,128")


def test_flops():
    causal = attngen.load_spec(SPECS / "softmax_causal.yaml")
    window = attngen.load_spec(SPECS / "sliding_window.yaml")
    shape = Shape(batch=1, q_len=4, heads=1, head_dim=8, value_dim=8)
    assert bench.flops(causal, shape, False) == 2 * (1 + 2 + 3 + 4) * 16
    assert bench.flops(causal, shape, True) == 3.5 * 2 * 10 * 16
    wide = Shape(batch=1, q_len=3000, heads=1, head_dim=8, value_dim=8)
    assert bench.flops(window, wide, False) == 2 * (1024 * 1025 // 2 + (3000 - 1024) * 1024) * 16
    decode = Shape(batch=1, q_len=1, k_len=100, heads=1, head_dim=8, value_dim=8)
    assert bench.flops(causal, decode, False) == 2 * 100 * 16
    gdn = attngen.load_spec(SPECS / "gated_deltanet.yaml")
    assert bench.flops(gdn, DENSE, False) == 6 * 128 * 128 * 4 * 8192 * 16


def test_plot_sweeps_sequence_length_at_the_tokens_per_batch():
    shapes = bench.sweep(DENSE)
    assert [(s.batch, s.q_len) for s in shapes][:3] == [(32, 1024), (16, 2048), (8, 4096)]
    assert (shapes[-1].batch, shapes[-1].q_len) == (1, 131072)
    decode = bench.sweep(parse_shape("4,8192,16,128,128,1"))
    assert {s.q_len for s in decode} == {1} and decode[-1].k_len == 131072


def test_ncu_table_reads_the_raw_page():
    """bench/ncu_kernels.py's table from ncu's raw CSV page (header, units, a row per kernel): the
    kernel's short name, its columns scaled, '-' for a metric ncu did not report, the largest stalls."""
    ncu = _bench_script("ncu_kernels")
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    raw = ('==PROF== Connected\n"ID","Kernel Name","gpu__time_duration.sum","launch__registers_per_thread",'
           f'"{stall.format("barrier")}","{stall.format("long_scoreboard")}","{stall.format("wait")}"\n'
           '"","","ns","register/thread","","",""\n'
           '"0","chunked_ut_kernel(float*)","1,234,000","255","2.5","7.1","0.5"\n')
    head, row = ncu.table(raw)
    assert head.startswith("kernel") and "regs" in head
    cells = row.split()
    assert cells[0] == "ut" and cells[1] == "1234.0" and "255.0" in cells and cells[2] == "-"
    assert row.endswith("long_scoreboard 7.1, barrier 2.5, wait 0.5")


def test_programs_per_multiprocessor_follow_cuda_occupancy_rules():
    """bench/compile_time.py's count of a kernel's programs resident on an sm_90 multiprocessor, with
    the figures ptxas and Triton gave for forgetting_attention's and softmax_causal's forward at B4 T8192
    H16 D128 bf16 (64 x 64 tiles, four warps, three stages): 1 KiB of the decay's tiles past half the
    shared memory leaves one program where softmax_causal's kernel has two."""
    ct = _bench_script("compile_time")
    assert ct.programs_per_sm(shared=115712, regs=174, warps=4) == (2, "shared")   # (115712 + 1024) * 2 = 228 KiB
    assert ct.programs_per_sm(shared=116760, regs=255, warps=4) == (1, "shared")
    assert ct.programs_per_sm(shared=0, regs=255, warps=4) == (2, "registers")      # 256 x 32 x 4 per program
    assert ct.programs_per_sm(shared=0, regs=40, warps=4) == (12, "registers")      # 40 rounds to 1280 a warp
    assert ct.programs_per_sm(shared=0, regs=16, warps=4) == (16, "warps")
    assert ct.programs_per_sm(shared=0, regs=16, warps=1) == (32, "programs")


def test_compile_time_counts_the_innermost_loops_machine_instructions():
    """bench/compile_time.py --sass: the instructions of each innermost loop of nvdisasm's text, by kind; an
    outer loop holding it, a barrier's few-instruction spin and a jump back from past the EXIT are not counted."""
    ct = _bench_script("compile_time")
    body = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", "MUFU.EX2 R1, R2", "FADD R3, R3, R1",
            "@P0 FFMA R4, R4, R5, R6", "F2FP.BF16.F32.PACK_AB R7, R8, R9", "LDGSTS.E.64 [R10], desc[UR6][R12.64]",
            "LDGDEPBAR",
            "LDG.E R11, desc[UR6][R14.64]", "LDS.128 R16, [R20]", "STL [R1+0x4], R3", "BAR.SYNC.DEFER_BLOCKING 0x0",
            "IADD3 R0, R0, 0x1, RZ", "ISETP.GE.AND P0, PT, R0, R2, PT"]
    lines = ["        .L_x_1:"]
    lines += [f"        /*{16 * i:04x}*/                   {op} ;" for i, op in enumerate(body)]
    lines += ["        /*0100*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R3 ;",
              "        .L_x_2:", "        /*0110*/                   @!P1 BRA `(.L_x_2) ;",   # a spin: not a loop
              "        /*0120*/              @!P0 BRA `(.L_x_1) ;",
              "        /*0130*/                   BRA `(.L_x_1) ;",                    # an outer loop around it
              "        /*0140*/                   EXIT ;"]
    lines += [f"        /*{0x150 + 16 * i:04x}*/                   NOP ;" for i in range(8)]
    lines += ["        /*0200*/                   BRA `(.L_x_1) ;"]                    # back from a stub after EXIT
    loops = ct.sass_loops("\n".join(lines))
    assert len(loops) == 1
    size, counts = loops[0]
    assert size == len(body) + 3
    assert counts == {"mma": 1, "exp2": 1, "fp32": 2, "cvt": 1, "async": 2, "ldg": 1, "lds": 1, "sts": 0,
                      "spill": 1, "bar": 1, "other": 5}
