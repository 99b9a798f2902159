"""attngen's command line: start-up cost (--help and --version import no torch), --version,
`check` (backend and form per row, every spec reported, kernels tested in float32) and
`explain` (the backend that runs)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import attngen

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env=environ, timeout=300)


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["check", "--help"], ["explain", "--help"],
                                  ["compile", "--help"]])
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

