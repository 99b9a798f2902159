"""Compile a spec's Triton kernels for Hopper (sm_90a) on any machine, GPU or not, and report each
kernel's compile time, warps, shared memory and ptxas's registers and spills.

    python bench/compile_time.py SPEC [--dtype bf16] [--T 63] [--Tk N] [--D 128] [--B 1] [--H 2] [--group 1] [--bwd]
        [--decode] [--h200 | --h100] [--launch "knob=value,..."] [--ptx DIR] [--loops] [--sass] [--module FILE]

The op runs on CPU tensors with Triton's CUDA target set to sm_90a and every launch turned into a
compilation only (no kernel runs; the outputs are garbage and are not looked at), so the kernels
and their specializations are exactly those a GPU call of the same shapes compiles. Needs the
Triton of the GPU machine (its ptxas ships in the wheel); TRITON_INTERPRET must be unset. A fresh
Triton cache each run, so the times are compilations. --launch sets chunked launch knobs after the
planner fitted its launch (bench/probe_launch.py's variants: its clamps bypassed, the stages
refitted), e.g. to see the registers and spills of a launch before it is timed on the GPU.
--ptx DIR writes each kernel's PTX there (its debug sections and line records cut: they name the
source lines), so that two versions of the templates can be held to the same code (`diff -r`)
where a change should leave a kernel as it was. --h200 takes the launches a call of these sizes takes on
an H200: the shipped table's entry (or its nearest bucket's) and the planner's fill of 132
multiprocessors, not the CPU's defaults; with --B 4 --H 16 --T 8192 those of the benchmark shape,
whose registers and spills say which tuned kernels spill (the launch is printed). --h100 the same for an
H100 (80GB HBM3): its table's entries where it has them, else the H200 table's (a sibling GPU's,
tuning.sibling_tables), else the planner's defaults. Each kernel's line
ends with how many of its programs an sm_90 multiprocessor holds at once and what limits it.
--loops lists each kernel's loops with the global loads in their bodies: those Triton's software
pipeline copies ahead into shared memory (cp.async, or the copy engine's TMA) and those it left as
plain loads, whose latency the loop waits on where their value is used; a tile (a vector load) among
those is worth a look (the state-gradient pass's stored dU, added to a product that Triton folded into
its accumulator, was one: BENCHMARKS.md 2026-12-06, ninth run). --sass assembles each kernel (ptxas,
then nvdisasm, both in Triton's wheel) and counts the machine instructions of its innermost loops by kind:
tensor-core products, exp2s, float32 arithmetic, loads, shared-memory traffic, barriers and the spill
loads and stores that land in the loop (a kernel's spilled bytes say nothing of where they fall). The
counts are static, per iteration and per thread (BENCHMARKS.md 2026-12-07, seventeenth run). --module FILE
compiles an edited rendering of the spec's generated module in place of its own (as bench/probe_launch.py --module).
--decode (softmax specs): a prepared decode step of --T tokens on a StateCache of --Tk rows per slot
(op.prepare_decode, the serving call's kernels: the forward on the cache, appending the keys itself
where they are one query block) in place of the op's call.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime import driver
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attngen
import attngen.runtime
from attngen.testing import Shape, random_inputs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Sm90Driver(CudaDriver):
    """The CUDA driver's compile-side answers for an H100 / H200, with no GPU behind them."""

    def __init__(self):
        pass

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def ptxas_info(ptxas: Path, ptx: Path) -> tuple[int | None, int | None]:
    """ptxas's registers per thread and bytes of spill stores (None where it did not say)."""
    out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull],
                         capture_output=True, text=True, check=False).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    return (int(regs.group(1)) if regs else None), (int(spills.group(1)) if spills else None)


# An sm_90 multiprocessor (H100, H200): 228 KiB of shared memory, of which each resident program also
# takes 1 KiB the system reserves; 65,536 registers, given to a warp in units of 256; at most 64 warps
# and 32 programs (CUDA's occupancy rules, compute capability 9.0).
SM90_SHARED, SM90_RESERVED, SM90_REGS, SM90_WARPS, SM90_PROGRAMS = 233472, 1024, 65536, 64, 32


def loop_loads(ptx: str) -> list[tuple[int, int, int, int]]:
    """Per loop of a kernel's PTX (a label LLVM marks as an inner loop's header, to the branch back to
    it): its length in lines, its plain global loads, how many of those load a vector (a tile's
    piece), and its asynchronous copies into shared memory (cp.async and bulk tensor copies)."""
    lines, loops = ptx.splitlines(), []
    for i, line in enumerate(lines):
        header = re.match(r"^(\$L__BB\d+_\d+):\s+// =>This Inner Loop Header", line)
        if not header:
            continue
        back = re.compile(r"bra(\.uni)?\s+" + re.escape(header.group(1)) + ";")
        end = next((j for j in range(i + 1, len(lines)) if back.search(lines[j])), len(lines))
        body = lines[i:end]
        plain = [b for b in body if "ld.global" in b]
        vector = [b for b in plain if re.search(r"ld\.global(\.\w+)*\.v[248]", b)]
        copies = sum(bool(re.search(r"cp\.async\.(ca|cg)\.shared|cp\.async\.bulk\.tensor", b)) for b in body)
        loops.append((end - i, len(plain), len(vector), copies))
    return loops


# --sass: the opcode classes counted per loop, in the order printed (an opcode counts in the first class
# whose prefix it starts with; the rest fall under "other")
SASS_CLASSES = (("mma", ("HGMMA", "HMMA")), ("exp2", ("MUFU",)),
                ("fp32", ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP")),
                ("cvt", ("F2FP", "F2F")), ("async", ("LDGSTS", "LDGDEPBAR", "UTMALDG", "UBLKCP")), ("ldg", ("LDG",)),
                ("lds", ("LDS", "LDSM")), ("sts", ("STS",)), ("spill", ("LDL", "STL")), ("bar", ("BAR",)))


def sass_loops(text: str) -> list[tuple[int, dict[str, int]]]:
    """Per innermost loop of a kernel's SASS (nvdisasm -c's text; a loop runs from a label to the branch
    back to it and holds no other such loop, and is not one of the few-instruction spins on a
    barrier's phase, nor a jump back from the out-of-line code after the kernel's EXIT): its
    instructions and their count per SASS_CLASSES class."""
    ops, labels = [], {}
    for line in text.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ops)
            continue
        ins = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)(.*?);", line)
        if ins:
            ops.append((ins.group(1), ins.group(2)))
    spans = []
    for i, (op, args) in enumerate(ops):
        target = re.search(r"\.(L_x_\d+)", args) if op == "BRA" else None
        if target and labels.get(target.group(1), i + 1) <= i:
            spans.append((labels[target.group(1)], i))
    loops = []
    for a, b in spans:
        if b - a < 8 or any(op == "EXIT" for op, _ in ops[a:b]) \
                or any((c, d) != (a, b) and a <= c and d <= b and d - c >= 8 for c, d in spans):
            continue
        counts = dict.fromkeys([name for name, _ in SASS_CLASSES] + ["other"], 0)
        for op, _ in ops[a:b + 1]:
            kind = next((name for name, prefixes in SASS_CLASSES if op.startswith(prefixes)), "other")
            counts[kind] += 1
        loops.append((b + 1 - a, counts))
    return loops


def programs_per_sm(shared: int, regs: int, warps: int) -> tuple[int, str]:
    """How many programs of a kernel an sm_90 multiprocessor holds at once, and what limits it
    (shared memory, registers, warps or the programs' cap): a kernel a few bytes past half a
    multiprocessor's shared memory runs one program per SM where it would run two."""
    per_warp = -(-regs * 32 // 256) * 256
    limits = {"shared": SM90_SHARED // (shared + SM90_RESERVED),
              "registers": SM90_REGS // (per_warp * warps), "warps": SM90_WARPS // warps, "programs": SM90_PROGRAMS}
    name = min(limits, key=limits.get)
    return limits[name], name


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--T", type=int, default=63)
    p.add_argument("--Tk", type=int, default=None, help="softmax specs: keys per sequence (default T; a decode "
                   "shape, e.g. --T 1 --Tk 32768, takes the split-KV forward)")
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--B", type=int, default=1, help="sequences")
    p.add_argument("--H", type=int, default=2, help="heads (linear specs: query / key heads)")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--h200", action="store_const", const="NVIDIA H200", dest="gpu",
                     help="the launches of an H200: its shipped table's and 132 multiprocessors")
    gpu.add_argument("--h100", action="store_const", const="NVIDIA H100 80GB HBM3", dest="gpu",
                     help="the launches of an H100 (80GB HBM3): its shipped table's and 132 multiprocessors")
    p.add_argument("--group", type=int, default=1,
                   help="linear specs: value heads per query / key head (grouped value heads)")
    p.add_argument("--bwd", action="store_true", help="also compile the backward kernels")
    p.add_argument("--sass", action="store_true",
                   help="count each kernel's innermost loops' machine instructions by kind")
    p.add_argument("--decode", action="store_true", help="softmax specs: a prepared decode step of --T tokens on a "
                   "cache of --Tk rows")
    p.add_argument("--launch", default="", help="chunked launch knobs set over the planner's, 'knob=value,...'")
    p.add_argument("--ptx", default=None, metavar="DIR", help="write each kernel's PTX (no debug sections) into DIR")
    p.add_argument("--loops", action="store_true", help="each kernel's loops: their plain global loads and async copies")
    p.add_argument("--module", default=None, metavar="FILE", help="an edited rendering of the spec's generated module")
    args = p.parse_args()
    if args.launch:
        # probe_launch's variants: knobs set over the fitted launch (planner.fit_chunked, patched there)
        import probe_launch
        probe_launch.OVERRIDE.update(probe_launch.parse_variant(args.launch, "--launch"))
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("compile_time.py compiles for the GPU: unset TRITON_INTERPRET")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    nvdisasm = ptxas.with_name("nvdisasm")
    if args.sass and not nvdisasm.exists():
        sys.exit(f"--sass: no nvdisasm at {nvdisasm}; it takes a Triton wheel that ships nvdisasm beside ptxas "
                 "(triton 3.6.0's does)")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="attngen_compile_")   # every kernel compiled afresh

    compiled = []

    def compile_only(self, *a, grid, warmup, **kw):
        return run(self, *a, grid=grid, warmup=True, **kw)

    def timed(self, *a, **kw):
        t = time.perf_counter()
        kernel = do_compile(self, *a, **kw)
        compiled.append((time.perf_counter() - t, self._fn_name.rsplit(".", 1)[-1], kernel))
        return kernel

    run, do_compile = JITFunction.run, JITFunction._do_compile
    JITFunction.run, JITFunction._do_compile = compile_only, timed
    driver.set_active(Sm90Driver())
    os.environ["ATTNGEN_BACKEND"] = "triton"
    attngen.runtime._use_kernels = lambda spec, q: True   # the kernels, on CPU tensors, without the interpreter
    attngen.runtime.route = lambda spec, device_type, dtype, head_dim=None: ("triton", "compile_time.py")

    if args.gpu:
        # the runtime's lookup as on that GPU (attngen.tuning.choose): its machine, its multiprocessors
        from attngen import tuning
        tuning.machine = lambda device: tuning.Machine(args.gpu, "9.0", triton.__version__)
        tuning.multiprocessors = lambda device: 132
        tuning._remembered.cache_clear()
        chosen = tuning.choose

        def choose(spec, family, call, dtype, device, chunk=None):
            result = chosen(spec, family, call, dtype, device, chunk)
            print(f"{family} launch, {result.source}: {result.launch}")
            return result
        tuning.choose = choose

    if args.module:
        # the edited module, imported before the op is made (as bench/probe_launch.py's --module)
        from attngen import codegen
        spec = attngen.spec.load_spec(Path(args.spec))
        codegen.load_edited_module(spec, Path(args.module))
    op = attngen.load(args.spec)
    dtype = DTYPES[args.dtype]
    if args.Tk is not None and op.spec.is_linear:
        p.error(f"--Tk {args.Tk}: only softmax specs take keys apart from the queries")
    if args.decode and (op.spec.is_linear or args.bwd):
        p.error("--decode: a softmax spec's forward alone")
    shape = Shape(batch=args.B, q_len=args.T, heads=args.H, head_dim=args.D, value_dim=args.D,
                  value_heads=args.H * args.group if op.spec.is_linear else None, k_len=args.Tk)
    inputs = {n: (t.to(dtype) if n in ("q", "k", "v") else t) for n, t in random_inputs(op.spec, shape, seed=0).items()}
    if args.bwd:
        for t in inputs.values():
            if t.is_floating_point():
                t.requires_grad_(True)
    t0 = time.perf_counter()
    if args.decode:
        rows = args.Tk or args.T
        window = dict(max_piece=args.T) if op.spec.mask == "sliding_window" else dict(max_len=rows)
        decay = op.spec.decay == "scalar"
        cache = attngen.StateCache(op, slots=args.B, heads=args.H, head_dim=args.D, value_dim=args.D, dtype=dtype,
                                   **window, **(dict(query_heads=args.H) if decay else {}))
        step = op.prepare_decode(cache, args.B, tokens=args.T, dtype=dtype)
        out = step(**{n: inputs[n][:, -args.T:].contiguous() for n in ("q", "k", "v") + (("g",) if decay else ())},
                   slots=torch.arange(args.B, dtype=torch.int32))
    else:
        out = op(**inputs)
    if args.bwd:
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    total = time.perf_counter() - t0

    print(f"{op.spec.name} {args.dtype} B={args.B} T={args.T} H={args.H} D={args.D} group={args.group}{' +bwd' if args.bwd else ''}: "
          f"{len(compiled)} kernels compiled in {total:.1f} s (Triton {triton.__version__}, sm_90a)")
    if args.ptx:
        Path(args.ptx).mkdir(parents=True, exist_ok=True)
    for i, (seconds, name, kernel) in enumerate(compiled):
        md = kernel.metadata
        if args.ptx and "ptx" in kernel.asm:
            ptx = kernel.asm["ptx"]
            ptx = ptx[:ptx.index(".section\t.debug")] if ".section\t.debug" in ptx else ptx
            ptx = "".join(line for line in ptx.splitlines(keepends=True)
                          if not line.lstrip().startswith((".loc", ".file")))
            (Path(args.ptx) / f"{i:02d}_{name}.ptx").write_text(ptx)
        info = ""
        if ptxas.exists() and "ptx" in kernel.asm:
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as tmp:
                tmp.write(kernel.asm["ptx"])
                tmp.flush()
                regs, spilled = ptxas_info(ptxas, Path(tmp.name))
            info = f"{regs if regs is not None else '?':>4} regs {spilled if spilled is not None else '?':>7} B spilled"
            if regs is not None:
                n, limit = programs_per_sm(md.shared, regs, md.num_warps)
                info += f"  {n:>2} per SM ({limit})"
        print(f"{seconds:7.1f} s  {name:28s} warps {md.num_warps}  shared {md.shared:>7} B  {info}")
        if args.loops and "ptx" in kernel.asm:
            for size, plain, vector, copies in loop_loads(kernel.asm["ptx"]):
                print(f"{'':11s}loop of {size} lines: {plain} plain global loads ({vector} of vectors), {copies} async copies")
        if args.sass and "cubin" in kernel.asm:
            with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as tmp:
                tmp.write(kernel.asm["cubin"])
                tmp.flush()
                sass = subprocess.run([str(nvdisasm), "-c", tmp.name], capture_output=True, text=True, check=True)
                for size, counts in sass_loops(sass.stdout):
                    print(f"{'':11s}loop of {size} instructions: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
