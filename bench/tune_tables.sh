#!/usr/bin/env bash
# Fill this GPU's shipped tuning table (attngen/tables): `attngen tune --missing` per spec, its shapes in one
# process (one import and one CUDA context for them all), each shape with a search budget. An illegal
# address from a miscompiled launch ends a process's CUDA context: the shapes it wrote stay in the table
# (tune writes each once searched), the shape it was searching is reported and left out, and a new
# process takes the shapes after it. --missing skips the shapes the table holds already (for the spec's
# current hash), so a refill cut short resumes where it stopped.
#   bash bench/tune_tables.sh [SPEC.yaml ...]      (default: every shipped spec with launch knobs)
# TUNE_SHAPES (default the benchmark shape 4,8192,16,128,128; several separated by spaces, or
# "training": the six shapes of attngen.cli.SHAPE_SETS), TUNE_DTYPE (bfloat16), TUNE_BUDGET (seconds of
# search per shape, 40), TUNE_LIMIT (seconds per shape, 150: a process's limit is that times its shapes),
# TUNE_OUT (the table's directory, attngen/tables), TUNE_LOG (a file for the whole search's report),
# TUNE_ALL=1 (search the shapes the table holds too: no --missing).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ $# -gt 0 ] || set -- specs/{deltanet,gated_deltanet,gla,kda,linear_transformer,mamba2,performer,retnet,softmax_causal,sliding_window,forgetting_attention,softmax_bidirectional}.yaml
shapes=${TUNE_SHAPES:-4,8192,16,128,128}
# a named set of shapes (attngen.cli.SHAPE_SETS), one by one
[ "$shapes" = training ] && shapes=$(python3 -c "from attngen.cli import SHAPE_SETS; print(' '.join(SHAPE_SETS['training']))")
missing=--missing
[ "${TUNE_ALL:-0}" = 1 ] && missing=
report=$(mktemp)
for spec in "$@"; do
  read -r -a todo <<< "$shapes"
  while [ ${#todo[@]} -gt 0 ]; do
    start=$(date +%s)
    timeout $(( ${TUNE_LIMIT:-150} * ${#todo[@]} )) python3 -m attngen.cli tune "$spec" --shapes "${todo[@]}" $missing \
      --dtype "${TUNE_DTYPE:-bfloat16}" --budget "${TUNE_BUDGET:-40}" --out "${TUNE_OUT:-attngen/tables}" > "$report" 2>&1
    rc=$?
    cat "$report" >> "${TUNE_LOG:-/dev/null}"
    grep -E "^[a-z_]+ |default\]|best:|stands|timed in|wrote|skipped|Error|error" "$report" | grep -v -E "round [0-9]+ .*: [0-9.]+ ms$"
    echo "$spec ${todo[*]}: exit $rc in $(( $(date +%s) - start )) s"
    [ $rc -eq 0 ] && break
    # the process ended early: the first shape it did not write is the one it was searching (left out);
    # the shapes after it go to a new process
    left=() failed=
    for s in "${todo[@]}"; do
      if grep -q -F "wrote $s's entry" "$report" || grep -q -E "skipped \(--missing\):.* $s( |$)" "$report"; then
        continue
      fi
      if [ -z "$failed" ]; then failed=$s; else left+=("$s"); fi
    done
    echo "$spec $failed: not recorded (exit $rc)"
    todo=("${left[@]}")
  done
done
rm -f "$report"
