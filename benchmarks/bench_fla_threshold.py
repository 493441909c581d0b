"""Which prefill chunks should run flash-linear-attention's chunked GDN (`ops/gdn.FLA_MIN_TOKENS`): one
engine over random 8-layer flash-next weights (bf16, prefix reuse off: every prompt cold), the threshold
set to each value in turn within every round, on the same prompts. Prints the median TTFT (s) and prefill
tok/s of each prompt length under each threshold as JSON; run on a CUDA machine with fla installed:

    python benchmarks/bench_fla_threshold.py [--thresholds 64 2048] [--lengths 256 1024 2047] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_prefill_constant import ttft_by_value  # noqa: E402

from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.ops import gdn  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--thresholds", type=int, nargs="+", default=[64, 2048])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2047])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    assert gdn._fla_chunk() is not None, "flash-linear-attention is not installed"
    label = "fla_min_tokens"
    rows = ttft_by_value(gdn, "FLA_MIN_TOKENS", args.thresholds, args.lengths, args.rounds, label=label)
    out = {"benchmark": "fla_threshold", "git": git_info(None), "hardware": hardware("cuda"),
           "rounds": args.rounds, "rows": rows}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
