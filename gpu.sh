#!/usr/bin/env bash
# The one GPU run: tests/gpu (compiled Triton kernels against the interpreter) and the
# benchmark against the baselines, in one call. Usage on the device machine:
#   bash gpu.sh [pytest args...]      (carry .whl with fla-core for the baselines)
# Full logs go to $OUT (when set); a short table is printed last.
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
python3 -m pytest tests/gpu -q -n 8 -p no:cacheprovider "$@" > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
grep -E "^FAILED" "$OUT/gpu_tests.log" | head -30
python3 bench/bench.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt" | tail -20
