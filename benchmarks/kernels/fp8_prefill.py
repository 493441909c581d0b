"""A prefill chunk's FP8 projections, side by side in one run: the dequantize-then-cuBLAS path
(ops/triton/fp8_dequant.py, then F.linear in bf16), the W8A8 Triton GEMM (ops/triton/fp8_gemm.py, the
activations' quantization included), torch's block-scaled `scaled_mm` (cuBLASLt 1x128 x 128x128, where the
build and card have it), and bf16 F.linear on the same dequantized weights (no FP8 at all). Shapes are the
released model's projections; CUDA graphs, median of trials, each with its TFLOP/s and its error against
float64 on the dequantized weights.

    python benchmarks/bench_kernels.py fp8_prefill --tokens 1024 4096 8192

Prints one JSON object (revision, hardware, command, rows).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from kernels.small_m_gemm import Timer
from nextserve.bench import git_info, hardware
from nextserve.ops.fp8 import BLOCK, Fp8Weight, quantize
from nextserve.ops.triton import fp8_gemm
from nextserve.ops.triton.fp8_dequant import triton_dequantize
from nextserve.ops.triton.fp8_gemm import quantize_activations, w8a8_linear

SHAPES = [  # (what, N, K)
    ("GDN in_proj qkv|z|b|a", 16480, 2560),
    ("QSA in_proj q|k|v|indexer", 13952, 2560),
    ("GDN/QSA out", 2560, 6144),
    ("shared expert gate|up", 1280, 2560),
    ("HC / head-sized", 10240, 2560),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--revision", default=None, help="record this git revision (a tree copied without .git)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    timer = Timer(dev)
    rows = []
    for what, N, K in SHAPES:
        q, s = quantize(torch.randn(N, K, device=dev) / K**0.5)
        w = Fp8Weight(q, s)
        w16 = triton_dequantize(w, torch.bfloat16)
        for T in args.tokens:
            x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
            ref = x.double() @ w.dequantize(torch.float64).T
            runs = {
                "bf16_cublas": lambda x=x, w16=w16: F.linear(x, w16),
                "fp8_dequant_cublas": lambda x=x, w=w: F.linear(x, triton_dequantize(w, x.dtype)),
                "w8a8_triton": lambda x=x, w=w: w8a8_linear(x, w),
                "w8a8_scaled_mm": lambda x=x, w=w: fp8_gemm.cublas_w8a8_linear(x, w),
                "quantize_activations": lambda x=x: quantize_activations(x),
            }
            row = {"shape": what, "N": N, "K": K, "T": T}
            for name, fn in runs.items():
                try:
                    us = timer.graph_us(fn, flush=False)
                except (RuntimeError, NotImplementedError) as e:  # scaled_mm: not in this build or card
                    row[name] = {"error": str(e).splitlines()[0][:200]}
                    continue
                row[name] = {"us": round(us, 1), "tflops": round(2 * T * N * K / us / 1e6, 1)}
                if name != "quantize_activations":
                    err = ((fn().double() - ref).norm() / ref.norm()).item()
                    row[name]["rel_err"] = float(f"{err:.3g}")
            rows.append(row)
            print("# " + json.dumps(row), file=sys.stderr)
    out = {"benchmark": "fp8_prefill", "git": git_info(args.revision), "hardware": hardware(dev),
           "command": " ".join(["python", "benchmarks/bench_kernels.py", *sys.argv]), "block": BLOCK,
           "rows": rows}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
