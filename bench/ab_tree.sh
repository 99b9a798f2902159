#!/usr/bin/env bash
# A kernel change against the tree before it, in one device call: bench/probe_launch.py (the oracle check
# at B1 T1000 H2 D128 and the forward + backward time with its kernels) on build/old, then on this tree,
# each with a Triton cache of its own. build/old holds the tree before the change:
#   rm -rf build/old && mkdir -p build/old && git archive HEAD attngen bench specs generated | tar -x -C build/old
# (carry build/old to the device), then: bash bench/ab_tree.sh SPECS [probe_launch args, e.g. --B 1 --T 32768]
specs=$1; shift
rows() { grep -v -i warn | grep -v "^  " | grep -v "^spec / variant"; }
echo "== before (build/old)"
(cd build/old && PYTHONPATH=$PWD TRITON_CACHE_DIR=/tmp/tc_old python3 bench/probe_launch.py --specs "$specs" \
    --variants "" --no-oracle "$@" 2>&1 | rows)
echo "== after (this tree)"
PYTHONPATH=$PWD TRITON_CACHE_DIR=$PWD/.triton_cache python3 bench/probe_launch.py --specs "$specs" --variants "" "$@" 2>&1 | rows
