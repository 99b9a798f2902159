#!/usr/bin/env bash
# Fill this GPU's shipped tuning table (attngen/tables): `attngen tune` per spec and shape, each in a
# process of its own (an illegal address from a miscompiled launch ends a process's CUDA context; the
# shapes and specs after it still run), each with a search budget and a time limit.
#   bash bench/tune_tables.sh [SPEC.yaml ...]      (default: every shipped spec with launch knobs)
# TUNE_SHAPES (default the benchmark shape 4,8192,16,128,128; several separated by spaces, or
# "training": the six shapes of attngen.cli.SHAPE_SETS),
# TUNE_DTYPE (bfloat16), TUNE_BUDGET (seconds of search per shape, 40), TUNE_LIMIT (seconds per spec and
# shape, 150), TUNE_OUT (the table's directory, attngen/tables), TUNE_LOG (a file for the whole search's report).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ $# -gt 0 ] || set -- specs/{deltanet,gated_deltanet,gla,kda,linear_transformer,mamba2,performer,retnet,softmax_causal,sliding_window,forgetting_attention,softmax_bidirectional}.yaml
shapes=${TUNE_SHAPES:-4,8192,16,128,128}
# a named set of shapes (attngen.cli.SHAPE_SETS), one by one
[ "$shapes" = training ] && shapes=$(python3 -c "from attngen.cli import SHAPE_SETS; print(' '.join(SHAPE_SETS['training']))")
for spec in "$@"; do
  for shape in $shapes; do
    start=$(date +%s)
    timeout "${TUNE_LIMIT:-150}" python3 -m attngen.cli tune "$spec" --shapes "$shape" \
      --dtype "${TUNE_DTYPE:-bfloat16}" --budget "${TUNE_BUDGET:-40}" --out "${TUNE_OUT:-attngen/tables}" 2>&1 \
      | tee -a "${TUNE_LOG:-/dev/null}" | grep -E "^[a-z_]+ |default\]|best:|timed in|wrote|skipped|Error|error" \
      | grep -v -E "round [0-9]+ .*: [0-9.]+ ms$"
    echo "$spec $shape: exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s"
  done
done
