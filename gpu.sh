#!/usr/bin/env bash
# The one GPU run: the benchmarks against the baselines, then tests/gpu (compiled Triton
# kernels against the interpreter: forward, gradients, training). On the device:
#   bash gpu.sh [pytest targets and args, default tests/gpu | smoke | shipped]
# The whole of tests/gpu takes longer than one 10-minute device call: give the forward file in
# one call and the backward and training files in the next (GPU_BENCH= skips the benchmark).
# Carry .whl with the fla-core wheel for the baselines. GPU_BENCH picks the benchmark passes, timed in
# one process ("fwd,bwd" by default, "" for none). Each part has its own time limit (GPU_BENCH_S,
# GPU_TESTS_S, seconds) so that every part's output comes back; full logs go to $OUT (when
# set); short tables are printed. Compiled kernels are cached in .triton_cache, so a second
# call on a machine still warm skips their compilation; the tests of one spec and dtype run in
# one process (--dist loadgroup), so each kernel variant is compiled once, and GPU_TESTS_N
# processes (12) compile side by side: compilation is most of the tests' time.
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/attngen_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton_cache
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
# The baselines' triton.autotune results on disk (Triton's TRITON_CACHE_AUTOTUNING): a fresh machine
# starts from those of earlier runs (bench/autotune/, their paths inside the Triton cache), so fla
# times its best configuration without benchmarking every one again; all of them come back in one file,
# $OUT/autotune.tar (the device returns a limited count of files: `tar -xf autotune.tar -C bench/autotune`
# keeps the new ones). The key of a result is the kernel, its configurations, Triton's version and the
# architecture (sm_90 for the H100 and the H200 alike): keep only those of the GPU the baselines are timed on.
# A miss autotunes as before.
export TRITON_CACHE_AUTOTUNING=1
[ -d bench/autotune ] && mkdir -p "$TRITON_CACHE_DIR" && cp -rn bench/autotune/. "$TRITON_CACHE_DIR"/
save_autotune() {
  (cd "$TRITON_CACHE_DIR" 2>/dev/null && find . -name "*.autotune.json" -print0 | tar -cf "$OUT/autotune.tar" --null -T -) 2>/dev/null
}
if [ -n "${GPU_BENCH-fwd,bwd}" ]; then
  timeout "${GPU_BENCH_S:-360}" python3 bench/bench.py --passes "${GPU_BENCH-fwd,bwd}" --profile ${BENCH_ARGS:-} > "$OUT/bench.txt" 2>&1
  echo "bench exit $?"; grep -v -i -e warn -e "rows = bench" "$OUT/bench.txt" | tail -c 7000
  save_autotune
fi
# `bash gpu.sh shipped`: `attngen bench` on every shipped spec, forward and forward + backward in one process
# (issue 10's table; GPU_BENCH_S limits it), then nothing else. All of it outlasts one device call (the
# baselines' first calls: fla's autotune, FlexAttention's compilation): SHIP_SPECS names a part of the specs
# (default specs/*.yaml), SHIP_PASSES the passes (fwd,bwd; "bwd" for forward + backward alone)
if [ "${1-}" = shipped ]; then
  # shellcheck disable=SC2086
  timeout "${GPU_BENCH_S:-360}" python3 -m attngen.cli bench ${SHIP_SPECS:-specs/*.yaml} --passes "${SHIP_PASSES:-fwd,bwd}" \
    > "$OUT/bench_shipped.txt" 2>&1
  echo "attngen bench exit $?"; grep -v -i -e warn "$OUT/bench_shipped.txt" | tail -c 9000
  save_autotune
  exit 0
fi
[ $# -gt 0 ] || set -- tests/gpu
# `bash gpu.sh smoke`: every spec at one shape, outputs (three dtypes) and bf16 gradients, a few minutes;
# the forward cases the planner or runtime routes around a GPU failure (BENCHMARKS.md 2026-12-02):
# vector decay in fp32 at D256 (16-token chunks), FAVOR+ in bf16 at D32 (the PyTorch forms); and the
# softmax backward's launch variants off the default (dkdv_split, dq_tma / dkdv_tma 2) that a search may take
[ "$1" = smoke ] && set -- tests/gpu -k "(forward_matches and T1000 and D128) or (gradients and T1000 and D128 and bf16) or (forward_matches and (T63 or T1000) and (((kda or gla) and fp32 and D256) or (performer and bf16 and D32))) or backward_passes_launch_variants"
[ "${GPU_TESTS_S:-360}" -gt 0 ] || exit 0
GPU_FAILURES=$OUT/gpu_failures.txt timeout "${GPU_TESTS_S:-360}" python3 -m pytest -v -n "${GPU_TESTS_N:-12}" --dist loadgroup -p no:cacheprovider --timeout=300 --durations=8 "$@" \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?: $(grep -c ' PASSED ' "$OUT/gpu_tests.log") passed, $(grep -c ' FAILED ' "$OUT/gpu_tests.log") failed"
grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -1
head -c 4000 "$OUT/gpu_failures.txt" 2>/dev/null
grep -A10 "slowest" "$OUT/gpu_tests.log" | head -12
