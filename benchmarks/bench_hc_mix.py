#!/usr/bin/env python3
"""The hyper-connection mix at the real Flash-Next widths (bf16, n=4, H=2560, r=320, down|inject 324 rows),
timed on the GPU: the four-launch chain it replaces (rms_norm, down_silu GEMV, up GEMV, mix_streams), the
one-launch kernel (ops/triton/hc_mix.py) and its three-launch split, and each split launch alone (where the
time goes). Each in a CUDA graph of 16 calls, with PDL on and off. Prints one JSON object."""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_decode_blocks import graph_us  # noqa: E402

from nextserve.bench import git_info, hardware  # noqa: E402
from nextserve.ops.hyper import down_silu, mix_streams  # noqa: E402
from nextserve.ops.linear import linear  # noqa: E402
from nextserve.ops.norms import rms_norm  # noqa: E402
from nextserve.ops.triton import hc_mix as hc  # noqa: E402
from nextserve.ops.triton.common import launch_pdl, pdl_mode  # noqa: E402

N, H, RANK = 4, 2560, 320


def _split_launch(mode: int, x, nw, wd, wu):
    """One of the split's launches alone, on buffers of a full call (for the phase breakdown)."""
    M = x.shape[0]
    R = wd.shape[0]
    p = hc._plan(N, H, R, RANK, x.element_size())
    dev = x.device
    bufs = dict(
        ws=torch.zeros((N * p.cps, M, R), dtype=torch.float32, device=dev),
        sq=torch.ones((p.tiles, M), dtype=torch.float32, device=dev),
        rstd=torch.ones((M, N), dtype=torch.float32, device=dev),
        a=torch.zeros((M, RANK), dtype=x.dtype, device=dev),
        v=torch.empty((M, R - RANK), dtype=x.dtype, device=dev),
        u=torch.empty((M, H), dtype=x.dtype, device=dev),
    )
    grid = {1: p.tiles, 2: triton.cdiv(R, p.bn), 3: p.units}[mode]

    def run():
        pdl = launch_pdl(x)
        hc._hc_mix[(grid,)](
            x, nw, wd, wu, bufs["ws"], bufs["sq"], bufs["rstd"], bufs["a"], bufs["v"],
            bufs["u"], bufs["ws"], M, x.stride(0), H, R, RANK, p.vc, p.units, 1e-6, 1.0 / H, 1.0 / N,
            CPS=p.cps, NS=N, NSP=N, BM=hc.BM, BN=p.bn, KC=p.kc, BK=min(hc.BK, p.kc), BC=p.bc,
            BKR=min(hc.BKR, p.rank_pad), MODE=mode, IEEE=False, PDL=pdl,
            LINES=triton.next_power_of_2(triton.cdiv(p.vc * RANK * 2, 128)), LINE_ELEMS=64,
            num_warps=hc.NUM_WARPS, num_stages=p.stages, launch_pdl=pdl,
        )  # fmt: skip

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--revision", default=None)
    ap.add_argument(
        "--configs",
        nargs="+",
        default=["8:3:65536:128"],
        help="NUM_WARPS:STAGES:TILE_BYTES:MIX_PROGRAMS of the kernel, each timed in turn",
    )
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    R = RANK + N
    nw = (torch.randn(N * H, device=dev, generator=g) * 0.1).bfloat16()
    wd = (torch.randn(R, N * H, device=dev, generator=g) / (N * H) ** 0.5).bfloat16()
    wu = (torch.randn(N * H, RANK, device=dev, generator=g) / RANK**0.5).bfloat16()

    def chain(x):
        xn = rms_norm(x, nw, 1e-6, group=H)
        av = down_silu(xn, wd, RANK, N, True)
        return mix_streams(linear(av[:, :RANK], wu, True), xn, N, H, True)

    rows = []
    with torch.inference_mode():
        for M in args.m:
            x = torch.randn(M, N * H, device=dev, generator=g).bfloat16()
            for pdl in (True, False):
                with pdl_mode(pdl):
                    rows.append({"M": M, "pdl": pdl, "kernel": "chain", "us": graph_us(lambda x=x: chain(x))})
                    for cfg in args.configs:
                        warps, stages, tile_bytes, programs = map(int, cfg.split(":"))
                        hc.NUM_WARPS, hc.STAGES, hc.TILE_BYTES, hc.MIX_PROGRAMS = (
                            warps,
                            stages,
                            tile_bytes,
                            programs,
                        )
                        hc._plan.cache_clear()
                        hc.triton_hc_mix(
                            x, nw, wd, wu, N, RANK, 1e-6
                        )  # the counters exist before any capture
                        row = {"M": M, "pdl": pdl, "kernel": cfg}
                        row["one_launch_us"] = graph_us(
                            lambda x=x: hc.triton_hc_mix(x, nw, wd, wu, N, RANK, 1e-6)
                        )
                        row["split_us"] = graph_us(
                            lambda x=x: hc.triton_hc_mix(x, nw, wd, wu, N, RANK, 1e-6, one_launch=False)
                        )
                        for mode in (1, 2, 3):
                            row[f"split{mode}_us"] = graph_us(_split_launch(mode, x, nw, wd, wu))
                        rows.append(row)
                    for r in rows[-1 - len(args.configs) :]:
                        print(f"# {r}", file=sys.stderr)
    out = {"benchmark": "hc_mix", "git": git_info(args.revision), "hardware": hardware(dev),
           "command": " ".join(["python", *sys.argv]), "rows": rows}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
