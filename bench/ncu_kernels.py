"""Hardware counters of each generated kernel of one forward (+ backward) step (GPU, Nsight Compute):
per kernel its time, compute and memory throughput against the peaks, DRAM bytes, registers,
occupancy (theoretical and achieved) and the largest warp-stall reasons, to tell where a kernel's
time goes before changing it.

    python bench/ncu_kernels.py --specs gated_deltanet,deltanet [--fwd] [--B 4 --T 8192 --H 16 --D 128]
        [--dtype bfloat16] [--launch knob=value,...] [--csv DIR]

It runs itself under `ncu --clock-control none` (the clocks left as they are), once per spec: the
step is run once outside the profiled range (compilation, the caching allocator), then once inside it
(cudaProfilerStart/Stop, ncu --profile-from-start off). ncu replays each kernel for its passes, saving
and restoring memory, so kernels writing in place are measured on their own inputs. --csv keeps the
raw per-kernel metrics (every column ncu reported) in DIR/<spec>.csv.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

SPECS = Path(__file__).resolve().parents[1] / "specs"
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis")
# (label, ncu raw metric, scale): the columns of the table
COLUMNS = (
    ("us", "gpu__time_duration.sum", 1e-3),
    ("SM%", "sm__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("mem%", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("dramGB/s", "dram__bytes.sum.per_second", 1e-9),
    ("dramMB", "dram__bytes.sum", 1e-6),
    ("regs", "launch__registers_per_thread", 1),
    ("smemKB", "launch__shared_mem_per_block_dynamic", 1e-3),
    ("occT%", "sm__maximum_warps_per_active_cycle_pct", 1),
    ("occA%", "sm__warps_active.avg.pct_of_peak_sustained_active", 1),
    ("grid", "launch__grid_size", 1),
    ("warps", "launch__block_size", 1 / 32),
    ("cyc/issue", "smsp__average_warp_latency_per_inst_issued.ratio", 1),
)
STALL = "smsp__average_warps_issue_stalled_"
STALL_END = "_per_issue_active.ratio"


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def table(raw: str, unit_rows: int = 1) -> list[str]:
    """The compact table of ncu's raw CSV page (a header row, a units row, a row per kernel)."""
    rows = list(csv.reader(io.StringIO(raw[raw.index('"ID"'):])))
    head, body = rows[0], rows[1 + unit_rows:]
    col = {name: i for i, name in enumerate(head)}
    out = ["kernel".ljust(34) + "".join(f"{label:>10s}" for label, _, _ in COLUMNS) + "  top stalls (warps per issue)"]
    for row in body:
        name = row[col["Kernel Name"]].split("(")[0].replace("chunked_", "").replace("_kernel", "")
        cells = []
        for label, metric, scale in COLUMNS:
            v = number(row[col[metric]]) if metric in col else None
            cells.append(f"{v * scale:10.1f}" if v is not None else f"{'-':>10s}")
        stalls = sorted(((number(row[i]) or 0.0, h[len(STALL):-len(STALL_END)]) for h, i in col.items()
                         if h.startswith(STALL) and h.endswith(STALL_END) and "not_issued" not in h), reverse=True)
        top = ", ".join(f"{s} {v:.1f}" for v, s in stalls[:4])
        out.append(f"{name[:34]:<34s}" + "".join(cells) + "  " + top)
    return out


def child(args) -> int:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import attngen
    from attngen import bench
    from attngen.testing import Shape, bench_inputs

    if args.launch:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import probe_launch  # patches planner.fit_chunked with its OVERRIDE
        probe_launch.OVERRIDE.update(probe_launch.parse_variant(args.launch, "--launch"))
    op = attngen.load(SPECS / f"{args.specs}.yaml")
    shape = Shape(batch=args.B, q_len=args.T, heads=args.H, head_dim=args.D, value_dim=args.D)
    inputs = bench_inputs(op.spec, shape, getattr(torch, args.dtype), "cuda", requires_grad=not args.fwd)
    run = bench.step(lambda: op(**inputs)[0], not args.fwd, inputs)
    with torch.set_grad_enabled(not args.fwd):
        run()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        run()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--specs", required=True)
    p.add_argument("--fwd", action="store_true", help="the forward alone (no autograd), else forward + backward")
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--launch", default="", help="ChunkedLaunch knobs set after the planner's fit (bench/probe_launch.py)")
    p.add_argument("--csv", default=None, metavar="DIR", help="keep ncu's raw CSV per spec in DIR")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    ncu = shutil.which("ncu") or next(iter(sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"))), None)
    if ncu is None:
        print("ncu_kernels: Nsight Compute (ncu) is not on this machine", file=sys.stderr)
        return 1
    for name in args.specs.split(","):
        cmd = [str(ncu), "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
               *[a for s in SECTIONS for a in ("--section", s)],
               sys.executable, __file__, "--child", "--specs", name, "--B", str(args.B), "--T", str(args.T),
               "--H", str(args.H), "--D", str(args.D), "--dtype", args.dtype] + (["--fwd"] if args.fwd else []) \
            + (["--launch", args.launch] if args.launch else [])
        res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        print(f"# {name} B{args.B} T{args.T} H{args.H} D{args.D} {args.dtype} {'fwd' if args.fwd else 'fwd+bwd'}"
              f"{' ' + args.launch if args.launch else ''}", flush=True)
        if '"ID"' not in res.stdout:
            print(f"ncu failed (exit {res.returncode}): {(res.stderr or res.stdout)[-1500:]}")
            continue
        if args.csv:
            Path(args.csv).mkdir(parents=True, exist_ok=True)
            (Path(args.csv) / f"{name}.csv").write_text(res.stdout[res.stdout.index('"ID"'):])
        print("\n".join(table(res.stdout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
