"""Host cost of a prepared decode step's Triton launches on any machine, GPU or not: Triton (the GPU
machine's, 3.6) compiles the kernels for sm_90a on the CPU (bench/compile_time.py's driver) and each
compiled kernel's C launcher is replaced by a no-op, so what is timed is the Python dispatch of
`kernel[grid](...)` (argument binding, specialization, cache lookup, launch metadata) and the step's
own host work, without the driver's launch.

    python bench/launch_cost_cpu.py softmax|linear

softmax: softmax_causal's step (B1, H16, D128 bf16, one query; append, split forward, merge);
linear: gated_deltanet's (the token loop). Prints the step's host time and each kernel's median.
"""
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
import torch  # noqa: E402
from triton.compiler.compiler import CompiledKernel  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import attngen  # noqa: E402
import attngen.runtime  # noqa: E402
import compile_time  # noqa: E402

driver.set_active(compile_time.Sm90Driver())
os.environ["ATTNGEN_BACKEND"] = "triton"
attngen.runtime._use_kernels = lambda spec, q: True
attngen.runtime.route = lambda *a, **k: ("triton", "stub")
CompiledKernel._init_handles = lambda self: setattr(self, "_run", lambda *a, **k: None)
orig = JITFunction.run
stats: dict = {}


def timed(self, *a, **kw):
    t = time.perf_counter()
    r = orig(self, *a, **kw)
    stats.setdefault(self._fn_name.rsplit(".", 1)[-1], []).append(time.perf_counter() - t)
    return r


JITFunction.run = timed
which = sys.argv[1] if len(sys.argv) > 1 else "softmax"
if which not in ("softmax", "linear"):
    sys.exit(f"expected softmax or linear, got {which!r}")
B = 1
if which == "softmax":
    op = attngen.load(str(ROOT / "specs" / "softmax_causal.yaml"))
    cache = attngen.StateCache(op, slots=B, heads=16, head_dim=128, value_dim=128, dtype=torch.bfloat16, max_len=4096)
    step = op.prepare_decode(cache, batch=B, dtype=torch.bfloat16)
    args = dict(q=torch.randn(B, 1, 16, 128, dtype=torch.bfloat16), k=torch.randn(B, 1, 16, 128, dtype=torch.bfloat16),
                v=torch.randn(B, 1, 16, 128, dtype=torch.bfloat16))
else:
    op = attngen.load(str(ROOT / "specs" / "gated_deltanet.yaml"))
    cache = attngen.StateCache(op, slots=B, heads=16, head_dim=128, value_dim=128)
    step = op.prepare_decode(cache, batch=B, dtype=torch.bfloat16)
    args = dict(q=torch.randn(B, 1, 16, 128, dtype=torch.bfloat16), k=torch.randn(B, 1, 16, 128, dtype=torch.bfloat16),
                v=torch.randn(B, 1, 16, 128, dtype=torch.bfloat16), g=-torch.rand(B, 1, 16), beta=torch.rand(B, 1, 16))
slots = torch.zeros(B, dtype=torch.int32)
step(**args, slots=slots)          # compiles
stats.clear()
t0 = time.perf_counter()
N = 2000
for _ in range(N):
    step(**args, slots=slots)
total = (time.perf_counter() - t0) / N
print(f"{which}: step {total * 1e6:.1f} us on the host, launches stubbed")
for name, ts in stats.items():
    print(f"  {name:28s} {statistics.median(ts) * 1e6:6.1f} us per launch (median of {len(ts)})")
