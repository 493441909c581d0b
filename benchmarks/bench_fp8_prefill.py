"""FP8 prefill projections (ops/linear.py: the weight dequantized in one Triton pass, ops/triton/fp8_dequant,
then cuBLAS) against what they replaced and against bf16, on the prefill projection shapes of the Flash-Next
widths, at chunk sizes M:

- bf16: F.linear on a bf16 weight (cuBLAS), the FP8 target;
- dequantize + cuBLAS: ops/fp8.py `dequantize` of the whole weight, then F.linear (the path before);
- one-pass dequantize + cuBLAS: the path now.
(The fused kernel that dequantized tiles in registers, measured against these in session 12, is at
5ad14e5: `git show 5ad14e5:benchmarks/bench_fp8_prefill.py`.)

Timing: CUDA events around REPS back-to-back calls, median of TRIALS; TFLOP/s = 2*M*N*K / time.
Prints one JSON object: python benchmarks/bench_fp8_prefill.py"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.ops.fp8 import Fp8Weight, quantize  # noqa: E402
from nextserve.ops.triton.fp8_dequant import triton_dequantize  # noqa: E402

SHAPES = [  # (what, N, K): the FP8 projections of a prefill chunk as the engine runs them (fused rows)
    ("GDN in_proj qkv|z|b|a", 16480, 2560),
    ("QSA in_proj q|k|v|indexer", 13952, 2560),
    ("GDN/QSA out", 2560, 6144),
    ("PLE key|value", 12800, 2560),
]
REPS, TRIALS = 10, 7


def timed_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(TRIALS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(REPS):
            fn()
        b.record()
        torch.cuda.synchronize()
        runs.append(a.elapsed_time(b) * 1000 / REPS)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, nargs="+", default=[128, 256, 512, 1024, 4096, 8192])
    p.add_argument("--revision", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    out = {
        "git": git_info(args.revision),
        "hardware": hardware(dev),
        "command": " ".join(["python", *sys.argv]),
    }
    rows = []
    for what, N, K in SHAPES:
        w = torch.randn(N, K, device=dev) / K**0.5
        q, s = quantize(w)
        fp8 = Fp8Weight(q, s)
        wb = w.bfloat16()
        for M in args.m:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            flop = 2 * M * N * K
            row = {"what": what, "N": N, "K": K, "M": M}
            row["bf16_us"] = timed_us(lambda x=x, wb=wb: F.linear(x, wb))
            row["one_pass_dequantize_cublas_us"] = timed_us(
                lambda x=x, fp8=fp8: F.linear(x, triton_dequantize(fp8, torch.bfloat16))
            )
            row["dequantize_cublas_us"] = timed_us(
                lambda x=x, fp8=fp8: F.linear(x, fp8.dequantize(torch.bfloat16))
            )
            for key in [k for k in row if k.endswith("_us")]:
                row[key] = round(row[key], 1)
                row[key.removesuffix("_us") + "_tflops"] = round(flop / row[key] / 1e6, 1)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    out["rows"] = rows
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
