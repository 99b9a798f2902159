"""A call's kernels compiled side by side before its first run (attngen/compiling.py), on the GPU:
in a fresh process with an empty Triton cache, every kernel of the first forward + backward is
compiled by the dry run (none at a launch of the real call), and outputs and gradients equal, bit
for bit, those of a process that compiles each kernel at its first launch.

Run on a CUDA machine: bash gpu.sh tests/gpu/<this file>
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# In a fresh process: one forward + backward of a spec; the outputs, gradients and, per compiled
# kernel, whether the dry run compiled it, saved to argv[2].
FRESH = '''
import sys
import torch, triton
import attngen
from attngen import compiling
from attngen.testing import Shape, bench_inputs
compiled = []
triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append((kw["fn"].name, compiling._COMPILE_ONLY.get()))
op = attngen.load(sys.argv[1])
inputs = bench_inputs(op.spec, Shape(batch=2, q_len=300, heads=4, head_dim=64, value_dim=64), torch.bfloat16, "cuda")
leaves = {n: t.requires_grad_(True) for n, t in inputs.items() if isinstance(t, torch.Tensor) and t.is_floating_point()}
out = op(**inputs)
o = out[0] if isinstance(out, tuple) else out
(o.float() * torch.linspace(-1, 1, o.shape[-1], device="cuda")).sum().backward()
torch.save({"o": o.cpu(), "compiled": compiled, **{"d" + n: t.grad.cpu() for n, t in leaves.items()}}, sys.argv[2])
'''


def fresh_call(spec: str, threads: int, path: Path) -> dict:
    env = dict(os.environ, ATTNGEN_COMPILE_THREADS=str(threads), TRITON_CACHE_DIR=tempfile.mkdtemp(),
               PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", FRESH, spec, str(path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(path)


@pytest.mark.parametrize("spec", ["gated_deltanet", "softmax_causal"])
def test_first_call_compiles_side_by_side(spec, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path = str(ROOT / "specs" / f"{spec}.yaml")
    side = fresh_call(path, 8, tmp_path / "side.pt")
    plain = fresh_call(path, 1, tmp_path / "plain.pt")
    assert side["compiled"] and all(dry for _, dry in side["compiled"]), side["compiled"]
    assert not any(dry for _, dry in plain["compiled"])
    assert sorted(name for name, _ in side["compiled"]) == sorted(name for name, _ in plain["compiled"])
    for name in plain:
        if name != "compiled":
            assert torch.equal(side[name], plain[name]), name
