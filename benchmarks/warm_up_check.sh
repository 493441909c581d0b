#!/usr/bin/env bash
# Issue 18's warm-up on one GPU: the no-compile test in a process of its own, then the reference workload
# (benchmarks/reference/, bf16) with the warm-up on and off, one after the other: the rewritten agent turn's
# TTFT is where a first-use compile showed (1.58 s at 06ef090).
#   bash benchmarks/warm_up_check.sh OUT_DIR
set -euo pipefail
out=${1:?usage: warm_up_check.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pytest -q -m gpu tests/gpu/test_warm_up.py 2>&1 | tail -3
ckpt=${CKPT:-/tmp/ref8}
[ -f "$ckpt/config.json" ] || python3 benchmarks/reference/make_ckpt.py "$ckpt" 8 > /dev/null
# each run with a compile cache of its own, empty at first; the last reuses the second's (a restart)
rm -rf /tmp/nextserve-tc-off /tmp/nextserve-tc-on
for run in "off false /tmp/nextserve-tc-off" "on true /tmp/nextserve-tc-on" "restart true /tmp/nextserve-tc-on"; do
  set -- $run
  python3 benchmarks/nextserve_side.py "$ckpt" "$out/ns_ref8_warm_$1.json" --warm-up "$2" \
    --compile-cache-dir "$3" 2>&1 | grep -v "it/s\|GB/s" | tail -1 | cut -c1-600
done
