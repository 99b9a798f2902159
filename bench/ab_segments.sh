#!/usr/bin/env bash
# The additive rules' state passes by segments (kernel_lib.chunked_state_segments) against one segment
# per sequence (SEGMENT_PROGRAMS=1), in one process per setting: bash bench/ab_segments.sh SPECS [probe_launch args]
specs=$1; shift
for programs in 1 default; do
  python3 - "$programs" "$specs" "$@" <<'PY' 2>&1 | grep -v -i warn | grep -v "^  " | grep -v "^spec / variant" | sed "s/^/SEGMENT_PROGRAMS=$programs /"
import runpy, sys
from attngen import kernel_lib
if sys.argv[1] != "default":
    kernel_lib.SEGMENT_PROGRAMS = int(sys.argv[1])
sys.argv = ["bench/probe_launch.py", "--specs", sys.argv[2], "--variants", ""] + sys.argv[3:]
runpy.run_path("bench/probe_launch.py", run_name="__main__")
PY
done
