#!/usr/bin/env bash
# FP8 against bf16 of the same build, side by side in one run (BENCHMARKS.md, "FP8"), then the released
# Flash-Next's full size (48 layers, the 2e7 n-gram base) in FP8 with the n-gram table in host memory.
# Random weights drawn on the device (`nextserve bench`): no checkpoint. JSON into the folder given.
#   bash benchmarks/bench_fp8.sh OUT_DIR [quick]
set -euo pipefail
out=${1:?usage: bench_fp8.sh OUT_DIR [quick]}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
common=(--no-transformers --no-profile --concurrency 1 8 32 --decode-steps 100 --budget-s 500)
if [ "${2:-}" = quick ]; then common=(--no-transformers --no-profile --concurrency 1 --decode-steps 20); fi
for q in none fp8; do  # the 8-layer reference config
  python3 -m nextserve.cli bench --preset flash-next --layers 8 --quantization "$q" \
    --prompt-lens 1024 62000 "${common[@]}" --out "$out/ref8_$q.json" > /dev/null
done
python3 -m nextserve.cli bench --preset flash-next --layers 48 --ngram-vocab-base 20000000 --quantization fp8 \
  --ple-table host --prompt-lens 1024 8192 62000 "${common[@]}" --out "$out/full48_fp8_host.json" > /dev/null
