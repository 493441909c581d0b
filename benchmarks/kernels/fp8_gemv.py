"""The FP8 small-M GEMV (ops/triton/gemv.py) on the decode step's FP8 projections: the 16-bit kernel on
the bf16 weight, the FP8 weight dequantized per tile in the 16-bit configuration (`post_scale=False`, the
earlier form), and each tile's partial scaled per column in the FP8 configuration (the default; its codes
turned bf16 by bit moves, and by Triton's own conversion for the side by side), with a sweep of FP8
configurations around the rule. Cold weights (an L2 flush between calls: small_m_gemm's Timer), CUDA
graphs, median of trials.

    python benchmarks/bench_kernels.py fp8_gemv --m 1 8 --sweep

Prints one JSON object (revision, hardware, command, rows, sweep, per-step sums).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton

from kernels.small_m_gemm import Timer, _gbps
from nextserve.bench import copy_bandwidth, git_info, hardware  # noqa: E402
from nextserve.ops.fp8 import Fp8Weight, quantize  # noqa: E402
from nextserve.ops.triton.common import FP8_BIT_MOVES  # noqa: E402
from nextserve.ops.triton.gemv import small_m_linear  # noqa: E402
from nextserve.ops.triton.gemv_config import gemv_config, k_splits  # noqa: E402

# (what, N, K, calls per 8-layer decode step): the projections `--quantization fp8` holds in FP8
SHAPES = [
    ("GDN in_proj qkv|z|b|a (6 layers)", 16480, 2560, 6),
    ("QSA in_proj q|k|v|indexer (2 layers)", 13952, 2560, 2),
    ("GDN/QSA out (8 layers)", 2560, 6144, 8),
]


def _triton_cvt(fn):
    """fn() with the FP8 codes turned bf16 by Triton's own conversion (common.FP8_BIT_MOVES off)."""
    FP8_BIT_MOVES[0] = False
    try:
        return fn()
    finally:
        FP8_BIT_MOVES[0] = True


def _sweep(
    timer: Timer, w: Fp8Weight, x: torch.Tensor, widths: list[int], stage_counts: list[int]
) -> list[dict]:
    N, K = w.shape
    rule = gemv_config(N, K, x.dtype, fp8=True)
    out = []
    for bn in widths:
        s_rule, _ = k_splits(N, K, bn, 128)
        k_tiles = triton.cdiv(K, 128)
        for want in sorted({1, s_rule, min(k_tiles, 2 * s_rule), max(1, s_rule // 2)}):
            s, _ = k_splits(N, K, bn, 128, want=want)
            for stages in stage_counts:
                for warps in (4, 8) if bn >= 64 else (4,):
                    cfg = dict(block_n=bn, block_k=128, splits=want, num_stages=stages, num_warps=warps)
                    us = timer.cold_us(lambda cfg=cfg: small_m_linear(x, w, **cfg))
                    out.append({"N": N, "K": K, "M": x.shape[0], "block_n": bn, "splits": s,
                                "num_stages": stages, "num_warps": warps, "us": round(us, 2),
                                "GBps": _gbps(N * K, us),
                                "rule": (bn, s, stages, warps) == (rule.block_n, rule.splits, rule.num_stages,
                                                                   rule.num_warps)})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8], help="row counts")
    ap.add_argument("--sweep", action="store_true", help="also sweep FP8 configurations (at the first M)")
    ap.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64, 128], help="the sweep's BLOCK_N")
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 4], help="the sweep's num_stages")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    timer = Timer(dev)
    bw = copy_bandwidth(dev, 1 << 30)
    rows, sweep = [], []
    for what, N, K, calls in SHAPES:
        w16 = (torch.randn(N, K, device=dev, dtype=torch.float32) / K**0.5).to(torch.bfloat16)
        q, s = quantize(w16.float())
        w8 = Fp8Weight(q, s)
        plain = w8.dequantize(torch.bfloat16)
        timer.rebase()
        for M in args.m:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x.double(), w8.dequantize(torch.float64))
            fns = {
                "bf16": lambda x=x, w=plain: small_m_linear(x, w),
                "fp8_tile_dequant": lambda x=x, w=w8: small_m_linear(x, w, post_scale=False),
                "fp8_post_scale_triton_cvt": lambda x=x, w=w8: _triton_cvt(lambda: small_m_linear(x, w)),
                "fp8_post_scale": lambda x=x, w=w8: small_m_linear(x, w),
            }
            row = {"shape": what, "N": N, "K": K, "M": M, "calls_per_step": calls,
                   "fp8_config": gemv_config(N, K, x.dtype, fp8=True)._asdict()}  # fmt: skip
            for name, fn in fns.items():
                us = timer.cold_us(fn)
                row[f"{name}_us"] = round(us, 2)
                row[f"{name}_GBps"] = _gbps(N * K * (2 if name == "bf16" else 1), us)
                err = ((fn().double() - ref).norm() / ref.norm()).item()
                row[f"{name}_rel_err_vs_fp64_dequantized"] = float(f"{err:.3g}")
            fast, cvt = fns["fp8_post_scale"](), fns["fp8_post_scale_triton_cvt"]()
            row["bit_moves_equal_triton_cvt"] = torch.equal(fast, cvt)
            rows.append(row)
            print(f"# {N}x{K} M={M}: " + ", ".join(f"{k} {row[f'{k}_us']}" for k in fns), file=sys.stderr)
        if args.sweep:
            x = torch.randn(args.m[0], K, device=dev, dtype=torch.bfloat16)
            sweep += _sweep(timer, w8, x, args.widths, args.stages)
        del w16, w8, plain
        torch.cuda.empty_cache()
    step = {}
    for M in args.m:
        mine = [r for r in rows if r["M"] == M]
        step[f"M={M}"] = {
            k: round(sum(r["calls_per_step"] * r[f"{k}_us"] for r in mine), 1)
            for k in ("bf16", "fp8_tile_dequant", "fp8_post_scale_triton_cvt", "fp8_post_scale")
        }
    best = {}
    for r in sweep:
        key = f"{r['N']}x{r['K']}"
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    out = {"benchmark": "fp8_gemv", "git": git_info(None), "hardware": hardware(dev),
           "command": " ".join(["python", *sys.argv]), "copy_bandwidth": bw, "step_us_sum": step,
           "rows": rows, "sweep_best": best, "sweep": sweep}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
