#!/usr/bin/env bash
# The one GPU run: the benchmark against the baselines, then tests/gpu (compiled Triton
# kernels against the interpreter: forward, gradients, training), in one call. On the device:
#   bash gpu.sh [pytest args...]      (carry .whl with the fla-core wheel for the baselines)
# Each part has its own time limit (GPU_BENCH_S, GPU_TESTS_S seconds) so that every part's
# output comes back; full logs go to $OUT (when set); short tables are printed.
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/attngen_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout "${GPU_BENCH_S:-180}" python3 bench/bench.py ${BENCH_ARGS:-} > "$OUT/bench.txt" 2>&1
echo "bench exit $?"; tail -16 "$OUT/bench.txt"
timeout "${GPU_TESTS_S:-360}" python3 -m pytest tests/gpu -q -n 8 -p no:cacheprovider "$@" > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
grep -E "^FAILED|^ERROR" "$OUT/gpu_tests.log" | head -40
