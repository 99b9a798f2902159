"""attngen's command line: start-up cost (--help and --version import no torch), --version,
`check` (backend and form per row, every spec reported, kernels tested in float32), `explain`
(the backend that runs, the kernels' launch) and `tune` / `bench` (without a GPU: one line and a
non-zero exit; their argument errors; bench on Triton's interpreter)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import attngen
from attngen.cli import main

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env=environ, timeout=300)


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["check", "--help"], ["explain", "--help"],
                                  ["compile", "--help"], ["tune", "--help"], ["bench", "--help"]])
def test_help_and_version_import_no_torch(argv):
    out = run_python(
        "import sys\n"
        "import attngen.cli\n"
        "try:\n"
        f"    attngen.cli.main({argv!r})\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "heavy = sorted(m for m in ('torch', 'triton', 'sympy', 'jinja2', 'networkx') if m in sys.modules)\n"
        "print('heavy:', heavy)\n")
    assert out.returncode == 0, out.stderr
    assert "heavy: []" in out.stdout, out.stdout


def test_version():
    out = run_python("import attngen.cli; attngen.cli.main(['--version'])")
    assert out.stdout.strip() == f"attngen {attngen.__version__}"


def test_import_attngen_is_cheap_and_load_still_works(tmp_path):
    out = run_python("import sys, attngen\n"
                     "print('torch' in sys.modules)\n"
                     "op = attngen.load('specs/mamba2.yaml')\n"
                     "print(type(op).__name__, 'torch' in sys.modules)\n"
                     "from attngen import Op, load, reference\n"
                     "print(isinstance(op, Op), load is attngen.load, callable(reference.reference))\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["False", "Op True", "True True True"], out.stdout
    # Each command imports what it needs, in a fresh process (an import order of its own).
    out = run_python(f"import attngen.cli; attngen.cli.main(['compile', 'specs/gla.yaml', '-o', {str(tmp_path)!r}])")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "gla.py").read_text() == (REPO / "generated" / "gla.py").read_text()



# --------------------------------------------------------------------------- check and explain

def run_cli(argv: list[str], backend: str, tmp_path) -> subprocess.CompletedProcess:
    """The command line in a fresh process, with a backend and a private kernel cache."""
    env = {"ATTNGEN_BACKEND": backend, "TRITON_INTERPRET": "1", "ATTNGEN_CACHE": str(tmp_path / "cache")}
    return run_python(f"import sys, attngen.cli; sys.exit(attngen.cli.main({argv!r}))", env)


def rows_of(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines()
            if line.split() and line.split()[-1] in ("pass", "FAIL")]


def test_check_triton_tests_the_kernels_in_float32(tmp_path):
    """ATTNGEN_BACKEND=triton: every row names the backend (triton), the dtype (float32: the kernels
    compute in float32) and the kernel that ran, and passes at the float32 tolerance."""
    out = run_cli(["check", "specs/mamba2.yaml", "--shape", "1,20,1,4,4"], "triton", tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = rows_of(out.stdout)
    assert len(rows) == 10 and all(r[-1] == "pass" for r in rows), out.stdout
    assert all(r[1:3] == ["triton", "float32"] for r in rows), out.stdout
    assert {" ".join(r[3:7]) for r in rows if r[3] == "parallel"} == {"parallel chunked kernel C=32"}
    assert any(r[3:6] == ["recurrent", "recurrent", "kernel"] for r in rows), out.stdout
    assert "ATTNGEN_BACKEND=triton, cpu tensors" in out.stdout


def test_check_reports_every_spec_past_a_bad_one(tmp_path):
    """A bad spec is one ERROR row naming the problem; the specs after it still run; the exit
    status says something failed."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nattention: linear\ndecay: scaler\n")
    out = run_cli(["check", str(bad), "specs/retnet.yaml", "--shape", "1,6,1,4,4", "--no-grad"], "torch", tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"{bad}:3: field 'decay': value 'scaler' is not allowed; did you mean 'scalar'?" in out.stdout
    rows = rows_of(out.stdout)
    assert len(rows) == 10 and all(r[0] == "retnet" and r[1:3] == ["torch", "float64"] for r in rows)
    assert all(r[-1] == "pass" for r in rows)
    assert "1 FAILED" in out.stdout


@pytest.mark.parametrize("shape, what", [("1,2", "expected B,T,H,K,V (five integers), got '1,2'"),
                                         ("1,0,2,8,8", "every size must be >= 1, got '1,0,2,8,8'")])
def test_a_bad_shape_is_named_once(shape, what, capsys):
    with pytest.raises(SystemExit) as info:
        main(["explain", "specs/gla.yaml", "--shape", shape])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: argument --shape: {what}")


@pytest.mark.parametrize("length", [1, 2, 3])
def test_check_packs_legal_sequences_at_any_length(length, monkeypatch, capsys):
    """The packed row's sequences (three, 2T + 1 tokens) are legal offsets at every --shape T, the
    shortest included: a row fails only where the spec's forms do."""
    monkeypatch.setenv("ATTNGEN_BACKEND", "torch")
    assert main(["check", "specs/retnet.yaml", "--shape", f"1,{length},1,4,4", "--no-grad"]) == 0
    rows = rows_of(capsys.readouterr().out)
    assert len(rows) == 10 and all(r[-1] == "pass" for r in rows)
    assert sum("varlen" in r for r in rows) == 5


def test_explain_names_the_backend_of_this_machine(tmp_path):
    out = run_cli(["explain", "specs/gla.yaml", "--shape", "1,100,2,8,8"], "auto", tmp_path)
    assert out.returncode == 0, out.stderr
    tail = out.stdout.split("backend on this machine", 1)[1]
    assert tail.startswith(" (ATTNGEN_BACKEND=auto, cpu tensors):"), out.stdout
    assert "float32, bfloat16, float16 inputs: torch, chunked C=64 (ATTNGEN_BACKEND=auto: the kernels run " \
           "on CUDA tensors, these are cpu)" in tail
    out = run_cli(["explain", "specs/gla.yaml", "--shape", "1,100,2,8,8"], "triton", tmp_path)
    tail = out.stdout.split("backend on this machine", 1)[1]
    assert "float32, bfloat16, float16 inputs: triton, chunked kernel C=64 (ATTNGEN_BACKEND=triton, Triton's " \
           "interpreter on the CPU)" in tail, out.stdout
    assert "float64 inputs: torch, chunked C=64 (float64 inputs of linear attention run the PyTorch forms: " \
           "the linear kernels compute in float32" in tail, out.stdout
    assert "chunked kernel launch, float32: chunk=64 BV=16 prepare_warps=4 wu_warps=0 states_BV=16 states_warps=4" in out.stdout, \
        out.stdout


# --------------------------------------------------------------------------- tune and bench

@pytest.mark.parametrize("argv", [["tune", "specs/gated_deltanet.yaml"],
                                  ["bench", "specs/gated_deltanet.yaml", "--shapes", "1,64,2,16,16"]])
def test_tune_and_bench_without_a_gpu_say_so_in_one_line(argv, monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.delenv("ATTNGEN_BACKEND", raising=False)
    assert main(argv) == 1
    out = capsys.readouterr()
    assert out.err.startswith(f"attngen {argv[0]}: no CUDA GPU here (torch.cuda.is_available() is False)"), out.err
    assert len(out.err.strip().splitlines()) == 1 and not out.out


def test_tune_takes_a_named_set_of_shapes(monkeypatch):
    """`--shapes training` is the six typical training shapes (16K and 128K tokens, K = V = 64, 128,
    256), given alongside plain shapes in order."""
    from attngen import tuning
    seen = []
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(tuning, "tune", lambda spec, shapes, *a, **kw: seen.append([
        (s.batch, s.q_len, s.heads, s.head_dim, s.value_dim) for s in shapes]))
    assert main(["tune", "specs/gla.yaml", "--shapes", "1,64,2,16,16", "training"]) == 0
    assert seen == [[(1, 64, 2, 16, 16), (2, 8192, 32, 64, 64), (16, 8192, 32, 64, 64), (2, 8192, 16, 128, 128),
                     (16, 8192, 16, 128, 128), (2, 8192, 8, 256, 256), (16, 8192, 8, 256, 256)]]


def test_tune_missing_skips_the_shapes_in_the_table(monkeypatch, tmp_path, capsys):
    """`--missing` searches only the shapes the table in --out holds no entry of for the spec's hash and
    dtype (another dtype's or spec's entries do not count): a refill resumes where it stopped."""
    import torch

    from attngen import load_spec, planner, tuning
    from attngen.inputs import Call
    fake = tuning.Machine("Fake GPU", "9.0", "3.6.0")
    spec = load_spec("specs/gla.yaml")
    call = Call(2, 8192, 8192, 32, 64, 64, 64, 2, 8192, 0.125, False, 2)
    launch = planner.chunked_launch(spec, call, torch.bfloat16)
    tuning.record([tuning.Entry(tuning.key(spec, "chunked", call, torch.bfloat16), spec.name, launch, "2,8192,32,64,64"),
                   tuning.Entry(tuning.key(spec, "chunked", call, torch.float16), spec.name, launch, "16,8192,32,64,64")],
                  fake, tmp_path)
    seen = []
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(tuning, "machine", lambda device: fake)
    monkeypatch.setattr(tuning, "tune", lambda spec, shapes, *a, **kw: seen.append(
        [f"{s.batch},{s.q_len},{s.heads},{s.head_dim},{s.value_dim}" for s in shapes]))
    assert main(["tune", "specs/gla.yaml", "--shapes", "2,8192,32,64,64", "16,8192,32,64,64", "--missing",
                 "--out", str(tmp_path)]) == 0
    assert seen == [["16,8192,32,64,64"]]
    assert "gla: in the table already, skipped (--missing): 2,8192,32,64,64" in capsys.readouterr().out
    assert main(["tune", "specs/gla.yaml", "--shapes", "2,8192,32,64,64", "--out", str(tmp_path)]) == 0
    assert seen[-1] == ["2,8192,32,64,64"]


@pytest.mark.parametrize("argv, error", [
    (["tune", "specs/gla.yaml", "--shapes", "4,8192,16"], "argument --shapes: expected B,T,H,K,V[,Tq[,H_kv]]"),
    (["tune", "specs/gla.yaml", "--shapes", "1,8,2,4,4,9"], "Tq = 9 must be at most T = 8"),
    (["tune", "specs/gla.yaml", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["tune", "specs/gla.yaml", "--budget", "-1"], "argument --budget: expected seconds, a finite number >= 0, got '-1'"),
    (["tune", "specs/gla.yaml", "--budget", "nan"], "argument --budget: expected seconds, a finite number >= 0, got 'nan'"),
    (["tune", "specs/gla.yaml", "--budget", "ten"], "argument --budget: expected seconds, a finite number >= 0, got 'ten'"),
    (["tune", "specs/gla.yaml", "--seed", "dq_bm=64"], "argument --seed: 'dq_bm' is no launch knob; knobs: BM, BN, BV,"),
    (["tune", "specs/gla.yaml", "--seed", "bwd_warps=eight"], "argument --seed: 'bwd_warps=eight': expected knob=value "
                                                              "with a non-negative integer value"),
    (["tune", "specs/gla.yaml", "--seed", "segments=-1"], "argument --seed: 'segments=-1': expected knob=value with a "
                                                          "non-negative integer value"),
    (["tune", "specs/gla.yaml", "--seed", ","], "argument --seed: expected knob=value,... (e.g. dq_BM=64,dq_warps=8), "
                                                "got ','"),
    (["bench", "specs/gla.yaml", "--vs", "fla,xformers"], "argument --vs: xformers is not a baseline; allowed: fla, "
                                                          "sdpa, flex"),
    (["bench", "specs/gla.yaml", "--shapes", "1,8,6,4,4,8,4"], "H_kv = 4 must divide H = 6"),
    (["bench", "specs/gla.yaml", "--passes", "fwd,back"], "argument --passes: expected fwd, bwd or fwd,bwd, got "
                                                          "'fwd,back'"),
    (["bench", "specs/gla.yaml", "--passes", "fwd,fwd"], "argument --passes: expected fwd, bwd or fwd,bwd"),
    (["bench", "specs/gla.yaml", "--passes", "fwd", "--bwd"], "argument --bwd: not allowed with argument --passes"),
])
def test_tune_and_bench_argument_errors(argv, error, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert error in capsys.readouterr().err


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_tune_and_bench_name_a_bad_spec_before_anything_runs(command, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nattention: linear\ndecay: scaler\n")
    assert main([command, "specs/gla.yaml", str(bad)]) == 2
    assert f"{bad}:3: field 'decay': value 'scaler' is not allowed" in capsys.readouterr().err


def test_compile_names_an_output_it_cannot_write(tmp_path, capsys):
    """-o/--output a file, or a directory under a file: one line naming the option and the path, exit
    code 2, no traceback; nothing is written."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert main(["compile", "specs/gla.yaml", "-o", str(a_file)]) == 2
    assert f"attngen: error: -o/--output: {str(a_file)!r} is a file, not a directory" in capsys.readouterr().err
    under = a_file / "sub"
    assert main(["compile", "specs/gla.yaml", "-o", str(under)]) == 2
    err = capsys.readouterr().err
    assert f"attngen: error: -o/--output: cannot write gla.py into {str(under)!r}: Not a directory" in err, err
    assert "Traceback" not in err and a_file.read_text() == ""


def test_bench_on_the_interpreter(tmp_path):
    """ATTNGEN_BACKEND=triton on Triton's interpreter: attngen and SDPA on the same inputs, their
    outputs compared; a linear spec's fla baseline says why it is skipped where fla is missing;
    a decode shape is skipped for the linear spec, with the reason."""
    out = run_cli(["bench", "specs/softmax_causal.yaml", "specs/mamba2.yaml", "--shapes", "1,40,2,16,16",
                   "1,40,2,16,16,1", "--vs", "sdpa,fla", "--dtype", "float32"], "triton", tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {(r.split()[0], r.split()[1], r.split()[3]): r for r in out.stdout.splitlines()
            if r.split() and r.split()[0] in ("softmax_causal", "mamba2")}
    assert set(rows) >= {("softmax_causal", "1,40,2,16,16", "attngen"), ("softmax_causal", "1,40,2,16,16", "SDPA"),
                         ("softmax_causal", "1,40,2,16,16,1", "SDPA"), ("mamba2", "1,40,2,16,16", "attngen"),
                         ("mamba2", "1,40,2,16,16", "fla"), ("mamba2", "1,40,2,16,16,1", "attngen")}, out.stdout
    for shape in ("1,40,2,16,16", "1,40,2,16,16,1"):
        assert float(rows["softmax_causal", shape, "SDPA"].split()[-1]) < 1e-5, out.stdout
    assert "skipped: Tq and H_kv are for softmax specs" in rows["mamba2", "1,40,2,16,16,1", "attngen"]
    try:
        import fla  # noqa: F401
    except ImportError:
        assert "fla baselines skipped: flash-linear-attention is not installed" in out.stdout


@pytest.mark.parametrize("flags, passes", [([], (False,)), (["--bwd"], (True,)), (["--passes", "bwd"], (True,)),
                                           (["--passes", "fwd,bwd"], (False, True)),
                                           (["--passes", "bwd,fwd"], (True, False))])
def test_bench_times_the_passes_asked_for_in_one_process(flags, passes, monkeypatch):
    """--passes fwd,bwd hands both passes to one bench.run (the baselines compile and autotune once);
    --bwd alone is forward + backward, no flag the forward."""
    from attngen import bench
    seen = []
    monkeypatch.setattr(bench, "no_device_reason", lambda: None)
    monkeypatch.setattr(bench, "run", lambda specs, shapes, dtype, device, bwd_passes, *a, **k:
                        seen.append(bwd_passes) or [])
    assert main(["bench", "specs/gla.yaml", "--vs", "none", *flags]) == 0
    assert seen == [passes]
