"""The oracle and the lowering are separate implementations (DESIGN.md §7): the interpreter
(reference.py) imports nothing from the lowering, and the lowering (forms, planner, codegen,
runtime) imports nothing from the interpreter, so no PyTorch form is compared with itself."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "attngen"
LOWERING = ("forms", "planner", "codegen", "runtime")


def imported(module: str) -> set[str]:
    """The attngen modules a module's source imports (relative or absolute, at any depth)."""
    names = set()
    for node in ast.walk(ast.parse((PACKAGE / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level or base.startswith("attngen"):
                base = base.removeprefix("attngen").lstrip(".")
                names |= {base.split(".")[0]} if base else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("attngen.")}
    return names


@pytest.mark.parametrize("module", LOWERING)
def test_lowering_does_not_import_the_oracle(module):
    assert "reference" not in imported(module)


def test_oracle_does_not_import_the_lowering():
    assert not imported("reference") & set(LOWERING)


def test_running_a_form_loads_no_oracle():
    code = ("import sys, torch, attngen; from attngen import runtime; "
            "op = runtime.load('specs/gated_deltanet.yaml'); "
            "q = torch.randn(1, 20, 2, 8); g = -torch.rand(1, 20, 2); b = torch.rand(1, 20, 2); "
            "op(q, q, q, g, b, form='chunked', chunk_size=16); "
            "print('attngen.reference' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent,
                         env={"ATTNGEN_BACKEND": "torch", "PATH": ""}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_the_package_ships_every_template_and_table():
    """pyproject.toml's package-data globs cover every template and table under attngen/templates and attngen/tables: a
    template folder left out works from a checkout (and an editable install) but not from a wheel."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["attngen"]
    package = root / "attngen"
    shipped = {path for pattern in globs for path in package.glob(pattern)}
    files = {*(package / "templates").rglob("*.jinja"), *(package / "tables").glob("*.json")}
    assert files - shipped == set(), f"not in pyproject.toml's package-data: {sorted(map(str, files - shipped))}"
