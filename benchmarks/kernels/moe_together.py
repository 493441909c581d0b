"""Several prefill chunks' routed experts in one call (`grouped_experts` over G chunks' rows with the
BLOCK_M one chunk alone takes) against one call a chunk, at the real Flash-Next widths (H=2560, E=512, k=10,
I=640): graph replay µs of both, and whether every row's bits equal its chunk's own call (the condition for
`--prefill-batch-chunks`: a chunk's result is what it is alone, C1). Prints JSON; run on a CUDA machine:
python benchmarks/bench_kernels.py moe_together [--fp8] [--chunk 4096] [--groups 1 2 4 8]
    [--tiles 64,4 128,8,128 128,8,128,128,3]
--tiles: BLOCK_M,warps[,gate/up BLOCK_N[,BLOCK_K[,stages[,down BLOCK_N[,down BLOCK_K]]]]] to sweep (warps
and stages for both kernels), or any of grouped_experts' keywords as key=value (n_fast=0,warps_down=4);
each row also says whether its bits equal the default tile's (whether the tile enters the numerics on
this GPU)."""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton

from nextserve.bench import git_info, hardware
from nextserve.bench.timing import graph_us
from nextserve.ops.fp8 import Fp8Weight, quantize
from nextserve.ops.moe import default_block_m
from nextserve.ops.triton.moe_grouped import grouped_experts

H, E, K, I = 2560, 512, 10, 640
TILE_KEYS = ("block_m", "warps", "block_n", "block_k", "stages", "block_n_down", "block_k_down")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--tiles", nargs="*", default=[], help="BLOCK_M,warps[,BLOCK_N,...] beside the default")
    args = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, device=dev, generator=g) / H**0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, I, device=dev, generator=g) / I**0.5).to(torch.bfloat16)
    if args.fp8:
        gate_up, down = Fp8Weight(*quantize(gate_up)), Fp8Weight(*quantize(down))
    bm = default_block_m(args.chunk * K, E)
    tiles = [{"block_m": bm}]
    tiles += [_tile(t) for t in args.tiles]
    rows = [_row(G, args.chunk, tile, bm, gate_up, down, g) for G in args.groups for tile in tiles]
    out = {"benchmark": "moe_together", "git": git_info(None), "hardware": hardware(dev),
           "weights": "fp8" if args.fp8 else "bf16", "chunk": args.chunk, "rows": rows}  # fmt: skip
    print(json.dumps(out, indent=1))


def _tile(text: str) -> dict:
    """grouped_experts' keywords from 'BLOCK_M,warps,...' (TILE_KEYS in order) or 'key=value,...'."""
    if "=" not in text:
        return dict(zip(TILE_KEYS, map(int, text.split(",")), strict=False))
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}


def _row(G: int, T: int, tile: dict, default_bm: int, gate_up, down, g):
    """G chunks of T tokens (uniform routing): one call for all against one call a chunk, at `tile`
    (grouped_experts' keywords; the others by its rules)."""
    dev = g.device
    x = torch.randn(G * T, H, device=dev, generator=g).to(torch.bfloat16)
    _, ids = torch.rand(G * T, E, device=dev, generator=g).topk(K, dim=-1)
    w = torch.rand(G * T, K, device=dev, generator=g)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
    spans = [(c * T, (c + 1) * T) for c in range(G)]

    tile = dict(tile)
    if "warps" in tile:
        tile.setdefault("warps_down", tile["warps"])
    if "stages" in tile:
        tile.setdefault("stages_down", tile["stages"])

    def together():
        return grouped_experts(x, w, ids, gate_up, down, **tile)

    def alone():
        return [grouped_experts(x[s:e], w[s:e], ids[s:e], gate_up, down, **tile) for s, e in spans]

    try:
        equal = bool(torch.equal(together(), torch.cat(alone())))
    except triton.runtime.errors.OutOfResources as err:  # a tile too big for the GPU: a row, not the end
        row = {"chunks": G, "tokens": G * T, **tile, "error": str(err)}
        print(json.dumps(row), file=sys.stderr, flush=True)
        return row
    default = grouped_experts(x, w, ids, gate_up, down, block_m=default_bm)
    same_as_default = bool(torch.equal(together(), default))
    t_us, a_us = graph_us(together), graph_us(alone)
    flops = 2 * G * T * K * 3 * I * H
    row = {"chunks": G, "tokens": G * T, **tile, "bits_equal_alone": equal,
           "bits_equal_default_block_m": same_as_default,
           "together_us": round(t_us, 1), "one_call_a_chunk_us": round(a_us, 1),
           "speedup": round(a_us / t_us, 3), "together_TFLOPs": round(flops / t_us / 1e6, 1)}  # fmt: skip
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


if __name__ == "__main__":
    main()
