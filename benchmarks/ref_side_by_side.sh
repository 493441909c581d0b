#!/usr/bin/env bash
# nextserve on the reference checkpoint and workload (benchmarks/reference/), the rows vLLM's JSON has:
# bf16 against FP8 (quantized on load from the same bf16 checkpoint), one after the other in one run.
#   bash benchmarks/ref_side_by_side.sh OUT_DIR [engine flags ...]     (CKPT=/tmp/ref8 by default)
set -euo pipefail
out=${1:?usage: ref_side_by_side.sh OUT_DIR [flags]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # (fla may be on the path)
ckpt=${CKPT:-/tmp/ref8}
[ -f "$ckpt/config.json" ] || python3 benchmarks/reference/make_ckpt.py "$ckpt" 8
for q in none fp8; do
  python3 benchmarks/nextserve_side.py "$ckpt" "$out/ns_ref8_$q.json" --quantization "$q" "$@"
done
