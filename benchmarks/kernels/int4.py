"""The int4 (W4A16) kernels against their bf16 and FP8 twins at the released widths, side by side in one run:
the small-M GEMV on the decode projections, and the grouped decode experts (E = 512, H = 2560, I = 640,
k = 10) at 1, 8 and 32 rows. Cold weights (an L2 flush between calls: small_m_gemm's Timer), CUDA graphs,
median of trials; each with its bytes a call over the time, and its error against float64 on the same
dequantized weights.

    python benchmarks/bench_kernels.py int4 --m 1 8 32

Prints one JSON object (revision, hardware, command, rows).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kernels.small_m_gemm import Timer, _gbps
from nextserve.bench import copy_bandwidth, git_info, hardware
from nextserve.ops.fp8 import Fp8Weight, quantize
from nextserve.ops.int4 import quantize_int4
from nextserve.ops.moe import route
from nextserve.ops.triton.gemv import small_m_linear
from nextserve.ops.triton.moe_grouped import grouped_decode_experts

GEMV_SHAPES = [  # (what, N, K): the projections the int4 and FP8 builds quantize
    ("GDN in_proj qkv|z|b|a", 16480, 2560),
    ("QSA in_proj q|k|v|indexer", 13952, 2560),
    ("GDN/QSA out", 2560, 6144),
]
E, H, I, TOP_K = 512, 2560, 640, 10
GROUP = 128


def _bytes(fmt: str, values: int) -> int:
    return {"bf16": 2 * values, "fp8": values, "int4": values // 2 + 2 * values // GROUP}[fmt]


def _weights(w16: torch.Tensor) -> dict:
    q, s = quantize(w16.float())
    return {"bf16": w16, "fp8": Fp8Weight(q, s), "int4": quantize_int4(w16, GROUP)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32], help="row counts")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    timer = Timer(dev)
    bw = copy_bandwidth(dev, 1 << 30)
    rows = []
    for what, N, K in GEMV_SHAPES:
        ws = _weights((torch.randn(N, K, device=dev) / K**0.5).to(torch.bfloat16))
        timer.rebase()
        for M in args.m:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            row = {"kernel": "gemv", "shape": what, "N": N, "K": K, "M": M}
            for fmt, w in ws.items():
                us = timer.cold_us(lambda x=x, w=w: small_m_linear(x, w))
                ref = torch.nn.functional.linear(
                    x.double(), w.double() if fmt == "bf16" else w.dequantize(torch.float64)
                )
                err = ((small_m_linear(x, w).double() - ref).norm() / ref.norm()).item()
                row |= {f"{fmt}_us": round(us, 2), f"{fmt}_GBps": _gbps(_bytes(fmt, N * K), us),
                        f"{fmt}_rel_err": float(f"{err:.3g}")}  # fmt: skip
            rows.append(row)
            print(f"# gemv {N}x{K} M={M}: " + ", ".join(f"{f} {row[f + '_us']}" for f in ws), file=sys.stderr)
        del ws
    gu = _weights((torch.randn(E, 2 * I, H, device=dev) / H**0.5).to(torch.bfloat16))
    dn = _weights((torch.randn(E, H, I, device=dev) / I**0.5).to(torch.bfloat16))
    timer.rebase()
    for M in args.m:
        x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
        w, ids = route(torch.randn(M, E, device=dev, dtype=torch.bfloat16), TOP_K, True)
        touched = ids.unique().numel()
        row = {"kernel": "grouped_decode_experts", "E": E, "H": H, "I": I, "M": M, "experts_touched": touched}
        for fmt in gu:
            us = timer.cold_us(lambda x=x, w=w, i=ids, f=fmt: grouped_decode_experts(x, w, i, gu[f], dn[f]))
            row |= {f"{fmt}_us": round(us, 2), f"{fmt}_GBps": _gbps(_bytes(fmt, touched * 3 * H * I), us)}
        rows.append(row)
        print(f"# experts M={M}: " + ", ".join(f"{f} {row[f + '_us']}" for f in gu), file=sys.stderr)
    for r in rows:
        r["int4_vs_fp8"] = round(r["fp8_us"] / r["int4_us"], 3) if r["int4_us"] else None
        r["int4_vs_bf16"] = round(r["bf16_us"] / r["int4_us"], 3) if r["int4_us"] else None
    out = {**git_info(), "hardware": hardware(dev), "command": " ".join(sys.argv), "copy_bandwidth": bw,
           "rows": rows}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
