"""The row-invariant Triton small-M GEMM against per-row cuBLAS calls (the CPU-style reference path)
and against one plain cuBLAS call (not row-invariant), on decode shapes of the real Flash-Next widths.
Prints JSON; run on a CUDA machine: python benchmarks/bench_small_m_gemm.py"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
import triton.testing

from nextserve.bench import git_info, hardware
from nextserve.ops.triton.gemv import small_m_linear

SHAPES = {"gdn in_proj_qkv": (10240, 2560), "expert gate_up": (1280, 2560), "expert down": (2560, 640),
          "qsa q_proj": (12288, 2560), "lm_head": (248320, 2560)}  # fmt: skip
TILES = [(32, 128), (64, 64), (16, 256)]


def _us(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median") * 1e3


def _row(name: str, w: torch.Tensor, x: torch.Tensor) -> dict:
    (N, K), M = w.shape, x.shape[0]
    row = {"shape": name, "N": N, "K": K, "M": M, "weight_bytes": N * K * 2}
    row["cublas_one_call_us"] = _us(lambda: F.linear(x, w))
    row["cublas_per_row_us"] = _us(lambda: [F.linear(x[i : i + 1], w) for i in range(M)])
    for bn, bk in TILES:
        row[f"triton_{bn}x{bk}_us"] = _us(lambda bn=bn, bk=bk: small_m_linear(x, w, bn, bk))
    return row


def main() -> None:
    dev = torch.device("cuda")
    rows = []
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K**0.5
        for M in (1, 8, 32):
            rows.append(_row(name, w, torch.randn(M, K, device=dev, dtype=torch.bfloat16)))
    out = {"benchmark": "small_m_gemm", "git": git_info(None), "hardware": hardware(dev),
           "command": " ".join(["python", *sys.argv]), "rows": rows}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
