"""The launch configuration of the row-invariant small-M GEMM (gemv.py): a rule over the weight's shape and
dtype, and the measured tables that replace it for some shapes. A function of (N, K, dtype, fp8) alone,
never of M: it is part of the numerics (gemv.py's NOTE on C1).

# NOTE: speed. Decode streams the weights: one pass over W at M <= 16; the row blocks of a weight tile
# are launched side by side (program id 0 runs fastest over row blocks), so at M = 17..48 the other row
# blocks re-read the tile from L2, not HBM. A grid of cdiv(N, 32) programs, each over all of K, gives
# 1..20 programs on 132 SMs for N <= 640, so: BLOCK_N drops to 16 when there would be fewer than
# TARGET_PROGRAMS (2 per SM of a 132-SM H100/H200) 32-wide tiles, and K is split into enough ranges to
# reach TARGET_PROGRAMS (at most one per BLOCK_K tile), unless the loop is shorter than
# MIN_SPLIT_K_TILES tiles, not worth the second launch. BLOCK_K keeps each weight tile at 8 KiB, with
# num_stages - 1 tiles in flight per program. benchmarks/bench_kernels.py small_m_gemm --sweep measures the
# alternatives. An FP8 weight has its own rule (`gemv_config(..., fp8=True)`): tiles of one 128-column scale
# block, up to 8 KiB of FP8 codes; benchmarks/bench_kernels.py fp8_gemv --sweep measures those.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

TARGET_PROGRAMS = 264  # a constant (2 x 132 SMs), never read from the device: it shapes the numerics
TILE_BYTES = 8192  # weight bytes per BLOCK_N x BLOCK_K tile
NUM_STAGES = 4  # pipeline depth of a 16-bit configuration
MIN_SPLIT_K_TILES = 8  # K is split only when the unsplit loop would run this many tiles or more
PRELOAD_TILES = 4  # a split of at most this many weight tiles loads them all before the PDL wait


class Config(NamedTuple):
    block_n: int
    block_k: int
    splits: int  # K splits (1: no workspace, one launch)
    split_tiles: int  # BLOCK_K tiles per split (the last split may get fewer)
    num_warps: int
    num_stages: int
    preload: int  # weight tiles loaded before the PDL wait (the whole split when it has <= PRELOAD_TILES)


# Shapes whose measured best configuration beats the rule's by more than the run-to-run spread (H200,
# `benchmarks/bench_kernels.py small_m_gemm --sweep`, cold weights, M = 1; H200). Like the
# rule, a function of (N, K, dtype): part of the numerics, never of M.
TUNED: dict[tuple[int, int, torch.dtype], tuple[int, int, int]] = {  # (block_n, block_k, K splits)
    # the attention output projections (GDN out, QSA o_proj): 12.5 us against the rule's 16.0
    (2560, 6144, torch.bfloat16): (64, 64, 8),
    # the hyper-connection down|inject stack, measured in the engine's graph (BENCHMARKS.md, Decode): 8 FP8
    # layers' c1 replay 1.296 ms against the rule's 1.333
    (324, 10240, torch.bfloat16): (32, 256, 20),
}
FP8_BLOCK_K = 128  # an FP8 tile's K columns: one scale block, so its partial is scaled once per column
FP8_TILE_BYTES = 8192
# an FP8 stage holds half a 16-bit stage's weight bytes; measured in the engine's CUDA graphs, not alone
FP8_NUM_STAGES = 8  # (BENCHMARKS.md, Decode)
# FP8 weights' measured best configurations (the same bench, `--fp8`), keyed like TUNED
FP8_TUNED: dict[tuple[int, int, torch.dtype], tuple[int, int, int]] = {
    (13952, 2560, torch.bfloat16): (32, 128, 2),  # QSA in_proj: 19.9 us against the rule's 21.0
    (2560, 6144, torch.bfloat16): (32, 128, 8),  # GDN out, QSA o_proj: 12.0 us against the rule's 19.9
}

INT4_BLOCK_K = 128  # an int4 tile's K columns: one group of the usual 128 (one scale a column a tile)
INT4_TILE_VALUES = 8192  # weights per tile (4 KiB of words): as many values as an FP8 tile holds
# a stage holds a quarter of a 16-bit stage's weight bytes, yet 4 deep beats 8 on every projection the int4
# builds quantize, at 1 row and at 32 (H100, `benchmarks/bench_kernels.py int4 --sweep`; BENCHMARKS.md, W4A16)
INT4_NUM_STAGES = 4
# int4 weights' measured best configurations (that sweep, cold weights, the best sum of M = 1 and M = 32),
# keyed like TUNED. The rule's TARGET_PROGRAMS keeps the in_proj stacks 32 wide (cdiv(N, 64) is 258 and 218
# programs, just short of 264), yet the 64-wide tile reads the longer runs of words; the outputs want more
# and wider programs than the rule's 16-wide tiles in 2 splits.
INT4_TUNED: dict[tuple[int, int, torch.dtype], tuple[int, int, int]] = {
    (16480, 2560, torch.bfloat16): (64, 128, 1),  # GDN in_proj: 26.8 / 35.9 us (M = 1 / 32), rule 30.7 / 42.0
    (13952, 2560, torch.bfloat16): (64, 128, 1),  # QSA in_proj: 26.6 / 34.8 us, rule 30.4 / 41.0
    (2560, 6144, torch.bfloat16): (32, 128, 8),  # GDN out, QSA o_proj: 15.4 / 20.0 us, rule 23.8 / 25.6
}
# int4_tiles.int4_dot's form in the GEMV: each tile dequantized in K order and one dot. With the K-order
# tile made by interleaves the eight-dot slab form ties it at M = 1 on the in_proj stacks (31.4 us both),
# is slower on the attention outputs (43.6 against 23.7) and 5-8x slower at M = 32 on every projection (H100,
# one call; BENCHMARKS.md, W4A16), while it stays the faster form in the grouped decode experts
# (moe_grouped.PREFILL_INT4_SLABS's NOTE).
INT4_SLABS = False


@functools.cache
def gemv_config(
    N: int, K: int, dtype: torch.dtype, target: int = TARGET_PROGRAMS, min_split: int = MIN_SPLIT_K_TILES,
    fp8: bool = False, int4: bool = False,
) -> Config:  # fmt: skip
    """The launch configuration for an [N, K] weight: a function of (N, K, dtype, fp8) only (it sets the
    numerics: a row's bits are fixed for a given config, whatever M). `target` and `min_split` are the
    rule's constants, overridden only by the benchmark that compares rules (which then ignores TUNED).
    `fp8`: an FP8 weight scaled after each tile's dot (POST_SCALE): tiles of one 128-column scale block,
    BLOCK_N as wide as still launches `target` programs (up to FP8_TILE_BYTES a tile), FP8_NUM_STAGES deep.
    `int4`: the same rule over tiles of INT4_BLOCK_K columns and up to INT4_TILE_VALUES weights (INT4_TUNED
    for the shapes measured)."""
    rule = (target, min_split) == (TARGET_PROGRAMS, MIN_SPLIT_K_TILES)
    tuned = (INT4_TUNED if int4 else FP8_TUNED if fp8 else TUNED).get((N, K, dtype)) if rule else None
    if tuned is not None:
        block_n, block_k, want = tuned
        splits = k_splits(N, K, block_n, block_k, want=want)
    elif fp8 or int4:
        # (FP8: a value is a byte, so FP8_TILE_BYTES is a count of values, as INT4_TILE_VALUES is)
        block_k, values = (INT4_BLOCK_K, INT4_TILE_VALUES) if int4 else (FP8_BLOCK_K, FP8_TILE_BYTES)
        block_n = 16
        while block_n * 2 * block_k <= values and triton.cdiv(N, block_n * 2) >= target:
            block_n *= 2
        splits = k_splits(N, K, block_n, block_k, target=target, min_split=min_split)
    else:
        block_n = 32 if triton.cdiv(N, 32) >= target else 16
        block_k = max(16, TILE_BYTES // (block_n * dtype.itemsize))  # 16-bit: 128 or 256; fp32: 64 or 128
        splits = k_splits(N, K, block_n, block_k, target=target, min_split=min_split)
    stages = INT4_NUM_STAGES if int4 else FP8_NUM_STAGES if fp8 else NUM_STAGES
    preload = 0 if int4 else preload_tiles(splits[1])  # (the int4 GEMV loads no tile before the PDL wait)
    return Config(block_n, block_k, *splits, num_warps=4, num_stages=stages, preload=preload)


def preload_tiles(split_tiles: int) -> int:
    """Weight tiles a program loads before the PDL wait: all of its split's when they are few (the small
    projections, bound by latency), none otherwise (a long K loop streams them pipelined anyway)."""
    return split_tiles if split_tiles <= PRELOAD_TILES else 0


def k_splits(
    N: int,
    K: int,
    block_n: int,
    block_k: int,
    want: int | None = None,
    target: int = TARGET_PROGRAMS,
    min_split: int = MIN_SPLIT_K_TILES,
) -> tuple[int, int]:
    """(splits, K tiles per split) for about `want` splits (default: the fewest that launch `target`
    programs, at most one per K tile, and none for fewer than `min_split` K tiles); no split is
    empty."""
    n_tiles, k_tiles = triton.cdiv(N, block_n), max(1, triton.cdiv(K, block_k))
    if want is None:
        # a short K loop is not worth the partials' round trip through L2
        want = triton.cdiv(target, n_tiles) if k_tiles >= min_split else 1
    splits = triton.cdiv(k_tiles, max(1, k_tiles // max(1, want)))
    tiles = triton.cdiv(k_tiles, splits)  # spread the remainder over the splits
    return triton.cdiv(k_tiles, tiles), tiles
