"""The int4 (W4A16) kernels against their bf16 and FP8 twins at the released widths, side by side in one run:
the small-M GEMV on the decode projections, the grouped decode experts (E = 512, H = 2560, I = 640, k = 10)
at 1, 8 and 32 rows, and the grouped prefill experts at 1,024 and 4,096 tokens. int4 runs in both forms of
int4_tiles.int4_dot: `int4` is the kernel's default form, `int4_slabs` / `int4_korder` the other one.
Cold weights (an L2 flush between calls: small_m_gemm's Timer), CUDA graphs, median of trials; each with
its bytes a call over the time, and the GEMV's error against float64 on the same dequantized weights.

    python benchmarks/bench_kernels.py int4 --m 1 8 32 --tokens 1024 4096 [--sweep] [--sweep-experts]

--sweep adds, per GEMV shape at each of --sweep-m, the int4 GEMV's launch configurations around the rule
(gemv_config(..., int4=True)): tile widths, K splits, pipeline depths and warps, each a row-invariant
configuration of its own (one serves every M, so a choice weighs 1 row against 32). --sweep-experts adds the
int4 decode experts' blocks (tile widths, depth, warps) at each of --m.

Prints one JSON object (revision, hardware, command, rows, sweep).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton

from kernels.small_m_gemm import Timer, _gbps
from nextserve.bench import copy_bandwidth, git_info, hardware
from nextserve.ops.fp8 import Fp8Weight, quantize
from nextserve.ops.int4 import quantize_int4
from nextserve.ops.moe import route
from nextserve.ops.triton.gemv import small_m_linear
from nextserve.ops.triton.gemv_config import INT4_BLOCK_K, INT4_SLABS, gemv_config, k_splits
from nextserve.ops.triton.moe_grouped import PREFILL_INT4_SLABS, grouped_decode_experts, grouped_experts

GEMV_SHAPES = [  # (what, N, K): the projections the int4 and FP8 builds quantize
    ("GDN in_proj qkv|z|b|a", 16480, 2560),
    ("QSA in_proj q|k|v|indexer", 13952, 2560),
    ("GDN/QSA out", 2560, 6144),
]
E, H, I, TOP_K = 512, 2560, 640, 10
GROUP = 128


def _bytes(fmt: str, values: int) -> int:
    return {"bf16": 2 * values, "fp8": values}.get(fmt, values // 2 + 2 * values // GROUP)


def _other(default_slabs: bool) -> str:
    """The name of int4's other form, beside a kernel whose default form is `default_slabs`."""
    return "int4_korder" if default_slabs else "int4_slabs"


def _weights(w16: torch.Tensor) -> dict:
    q, s = quantize(w16.float())
    return {"bf16": w16, "fp8": Fp8Weight(q, s), "int4": quantize_int4(w16, GROUP)}


def _say(what: str, row: dict, runs: dict) -> None:
    print(f"# {what}: " + ", ".join(f"{f} {row[f + '_us']}" for f in runs), file=sys.stderr)


def _sweep(timer: Timer, w, x: torch.Tensor) -> list[dict]:
    """The int4 GEMV's configurations around the rule at x's row count (module docstring)."""
    N, K = w.shape
    rule = gemv_config(N, K, x.dtype, int4=True)
    rule_key = (rule.block_n, rule.splits, rule.num_stages, rule.num_warps)
    out = []
    for bn in (16, 32, 64):
        s_rule, _ = k_splits(N, K, bn, INT4_BLOCK_K)
        k_tiles = triton.cdiv(K, INT4_BLOCK_K)
        for want in sorted({1, s_rule, min(k_tiles, 2 * s_rule), min(k_tiles, 4 * s_rule)}):
            s, _ = k_splits(N, K, bn, INT4_BLOCK_K, want=want)
            for stages in (4, 8):
                for warps in (4, 8) if bn >= 64 else (4,):
                    cfg = dict(
                        block_n=bn, block_k=INT4_BLOCK_K, splits=want, num_stages=stages, num_warps=warps
                    )
                    us = timer.cold_us(lambda cfg=cfg: small_m_linear(x, w, **cfg))
                    is_rule = (bn, s, stages, warps) == rule_key
                    out.append({"N": N, "K": K, "M": x.shape[0], "block_n": bn, "splits": s,
                                "num_stages": stages, "num_warps": warps, "us": round(us, 2),
                                "rule": is_rule})  # fmt: skip
                    print(f"# sweep row {out[-1]}", file=sys.stderr)  # kept if the run is cut short
    best = min(out, key=lambda r: r["us"])
    print(f"# sweep {N}x{K} M={x.shape[0]}: best {best}", file=sys.stderr)
    return out


def _sweep_experts(timer: Timer, gu, dn, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> list[dict]:
    """The int4 decode experts' blocks around the defaults at x's row count: gate/up and down tile widths,
    pipeline depth and warps (both kernels alike), in the default form (module docstring)."""
    out = []
    for bn, bn_down in ((32, 64), (64, 64), (32, 128), (64, 128), (16, 64)):
        for stages in (4, 6, 8):
            for warps in (4, 8):
                cfg = dict(block_n=bn, block_n_down=bn_down, stages=stages, stages_down=stages, warps=warps,
                           warps_down=warps)  # fmt: skip
                us = timer.cold_us(lambda cfg=cfg: grouped_decode_experts(x, w, ids, gu, dn, **cfg))
                out.append({"M": x.shape[0], **cfg, "us": round(us, 2)})
                print(f"# experts sweep row {out[-1]}", file=sys.stderr)
    best = min(out, key=lambda r: r["us"])
    print(f"# experts sweep M={x.shape[0]}: best {best}", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32], help="row counts")
    ap.add_argument("--tokens", type=int, nargs="*", default=[1024, 4096], help="prefill chunk tokens")
    ap.add_argument("--sweep", action="store_true", help="also sweep the int4 GEMV's configurations")
    ap.add_argument("--sweep-m", type=int, nargs="+", default=[1, 32], help="row counts of the sweep")
    ap.add_argument("--sweep-experts", action="store_true", help="also sweep the int4 decode experts' blocks")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    timer = Timer(dev)
    bw = copy_bandwidth(dev, 1 << 30)
    rows, sweep = [], []
    for what, N, K in GEMV_SHAPES:
        ws = _weights((torch.randn(N, K, device=dev) / K**0.5).to(torch.bfloat16))
        timer.rebase()
        for M in args.m:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            row = {"kernel": "gemv", "shape": what, "N": N, "K": K, "M": M}
            runs = {f: (w, {}) for f, w in ws.items()}
            runs[_other(INT4_SLABS)] = (ws["int4"], {"int4_slabs": not INT4_SLABS})
            for fmt, (w, kw) in runs.items():
                us = timer.cold_us(lambda x=x, w=w, kw=kw: small_m_linear(x, w, **kw))
                ref = torch.nn.functional.linear(
                    x.double(), w.double() if fmt == "bf16" else w.dequantize(torch.float64)
                )
                err = ((small_m_linear(x, w, **kw).double() - ref).norm() / ref.norm()).item()
                row |= {f"{fmt}_us": round(us, 2), f"{fmt}_GBps": _gbps(_bytes(fmt, N * K), us),
                        f"{fmt}_rel_err": float(f"{err:.3g}")}  # fmt: skip
            rows.append(row)
            _say(f"gemv {N}x{K} M={M}", row, runs)
        if args.sweep:
            timer.rebase()
            for M in args.sweep_m:
                sweep += _sweep(timer, ws["int4"], torch.randn(M, K, device=dev, dtype=torch.bfloat16))
        del ws
    gu = _weights((torch.randn(E, 2 * I, H, device=dev) / H**0.5).to(torch.bfloat16))
    dn = _weights((torch.randn(E, H, I, device=dev) / I**0.5).to(torch.bfloat16))
    timer.rebase()
    for M in args.m:
        x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
        w, ids = route(torch.randn(M, E, device=dev, dtype=torch.bfloat16), TOP_K, True)
        touched = ids.unique().numel()
        row = {"kernel": "grouped_decode_experts", "E": E, "H": H, "I": I, "M": M, "experts_touched": touched}
        runs = {f: (f, {}) for f in gu} | {_other(True): ("int4", {"int4_slabs": False})}
        for fmt, (f, kw) in runs.items():
            us = timer.cold_us(
                lambda x=x, w=w, i=ids, f=f, kw=kw: grouped_decode_experts(x, w, i, gu[f], dn[f], **kw)
            )
            row |= {f"{fmt}_us": round(us, 2), f"{fmt}_GBps": _gbps(_bytes(fmt, touched * 3 * H * I), us)}
        rows.append(row)
        _say(f"experts M={M}", row, runs)
        if args.sweep_experts:
            sweep += _sweep_experts(timer, gu["int4"], dn["int4"], x, w, ids)
    for T in args.tokens:
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        w, ids = route(torch.randn(T, E, device=dev, dtype=torch.bfloat16), TOP_K, True)
        touched = ids.unique().numel()
        row = {"kernel": "grouped_experts", "E": E, "H": H, "I": I, "T": T, "experts_touched": touched}
        other = {"int4_slabs": not PREFILL_INT4_SLABS}
        runs = {f: (f, {}) for f in gu} | {_other(PREFILL_INT4_SLABS): ("int4", other)}
        for fmt, (f, kw) in runs.items():
            us = timer.cold_us(
                lambda x=x, w=w, i=ids, f=f, kw=kw: grouped_experts(x, w, i, gu[f], dn[f], **kw)
            )
            row |= {f"{fmt}_us": round(us, 2), f"{fmt}_tok_per_s": round(T / us * 1e6)}
        rows.append(row)
        _say(f"prefill experts T={T}", row, runs)
    for r in rows:
        r["int4_vs_fp8"] = round(r["fp8_us"] / r["int4_us"], 3) if r["int4_us"] else None
        r["int4_vs_bf16"] = round(r["bf16_us"] / r["int4_us"], 3) if r["int4_us"] else None
    out = {**git_info(), "hardware": hardware(dev), "command": " ".join(sys.argv), "copy_bandwidth": bw,
           "rows": rows, "sweep": sweep}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
