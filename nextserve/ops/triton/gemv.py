"""Row-invariant small-M GEMM (decode, batched decode, verify windows) for CUDA.

# NOTE: why a row's bits never depend on M or on the rows beside it (C1):
# - the launch configuration (BLOCK_N, BLOCK_K, the split count and K range of each split, num_warps,
#   num_stages) is a function of (N, K, dtype) alone (gemv_config.py), never of M or of the data; M is
#   `do_not_specialize`, so one compiled kernel serves every M (Triton would otherwise compile M == 1
#   as a constant). There is no separate M == 1 path;
# - rows are padded to a block of BLOCK_M = 16 rows (32 when M > 16: one pass over a weight tile where two
#   16-row blocks would read it twice) and multiplied with tl.dot. A tensor-core MMA (or the float32
#   FMA dot) computes an output element from its own row of x and column of W only, by the same
#   arithmetic (the m16n8k16 instruction over the same K steps) at every row position of either block:
#   padded rows are zeros that never enter a real row's sum, and the same instruction sequence runs
#   whether 1 or 32 rows are real. On the H200 the 32-row block gives the 16-row block's bits on every
#   decode projection (bench_kernels.py small_m_gemm's block_m32_equal), and tests/gpu/test_small_m_gemm.py
#   checks rows alone against rows in batches of 2..40;
# - split s of S accumulates its own fixed K range, BLOCK_K tile after tile in ascending order, in
#   float32. With S > 1 the partials go to a float32 workspace [S, M, N] and a second kernel adds them
#   elementwise in the fixed order split 0, 1, ..., S-1 (unrolled adds, no tree, no atomics) and rounds
#   once to the output dtype; with S == 1 the accumulator is rounded and stored directly (one launch);
# - with S > 1 and a tile counter available (common.tile_counters), the add is done in the same launch
#   instead: each split stores its partial, then bumps its tile's counter (a release/acquire atomic after
#   a CTA barrier); the program that arrives last adds the S partials in the same fixed order 0, 1, ..., S-1
#   (loads from L2) and resets the counter to 0 for the next call. Which program arrives last varies;
#   what it computes does not: the bits equal the two-launch path's (tests check both);
# - M changes only how many row blocks are launched and where a row's results are stored, not what is
#   computed for it. Pointer-alignment specialisation (an unaligned view of x) changes load widths, not
#   the loaded values or the arithmetic.
# cuBLAS, in contrast, may pick its algorithm (and split-K) from M.
# NOTE: speed: the configuration rule and its measured tables are gemv_config.py's. An FP8 weight's codes
# become bf16 by bit moves (common.fp8_codes), not by Triton's conversion (five conversion instructions
# per two codes): the same bits, 1.07-1.16x faster on the decode projections (BENCHMARKS.md, Decode).
# The grouped experts keep Triton's conversion: the bit moves there measured slower (same session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8 import Fp8Weight
from ..int4 import Int4Weight
from .common import (
    COUNTERS,
    fp8_bit_moves,
    fp8_codes,
    launch_pdl,
    pdl_start,
    sigmoid,
    tile_counters,
    unit_stride,
)
from .gemv_config import FP8_BLOCK_K, INT4_SLABS, gemv_config, k_splits, preload_tiles
from .int4_tiles import check_block_k, int4_dot, int4_launch_args

BLOCK_M = 16
REDUCE_BLOCK = 256


@triton.jit(do_not_specialize=["M"])
def _small_m_gemm(
    x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, K_SPLIT,
    stride_xm, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, FIXUP: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    PRELOAD: tl.constexpr = 0, SILU_COLS: tl.constexpr = 0, silu_scale=1.0,
    MIX_N: tl.constexpr = 0, mix_x_ptr=None, MIX_H=1, stride_mx=0, mix_inv_n=1.0,
    W_FP8: tl.constexpr = False, s_ptr=None, stride_sn=0, K_BLOCKS=1, POST_SCALE: tl.constexpr = False,
    FAST_FP8: tl.constexpr = False,
    W_INT4: tl.constexpr = False, z_ptr=None, GROUP: tl.constexpr = 1, HAS_ZERO: tl.constexpr = False,
    INT4_SLABS: tl.constexpr = False,
):  # fmt: skip
    """Program (row block x N tile, split): x[rows, k range] @ W[cols, k range]^T, the k range being
    [split * K_SPLIT, min(K, (split + 1) * K_SPLIT)) in BLOCK_K tiles, in order. SPLIT: store the float32
    partial to ws[split, rows, cols] (a [S, M, N] workspace), and with FIXUP the tile's last program adds
    the partials in split order into out; else round and store to out[rows, cols]. Columns below SILU_COLS
    are stored as silu(y * silu_scale) instead (`_epilogue`). MIX_N > 0 (one split): the N = MIX_N *
    MIX_H columns are the hyper-connection logits of MIX_N streams, and out [M, MIX_H] gets their stream
    mix with mix_x [M, N] (`_mix_epilogue`). W_FP8: W is float8_e4m3fn with float32 scales s [cdiv(N, 128),
    K_BLOCKS] (row stride stride_sn), each tile dequantized in registers to x's dtype (`_weight_tile`); with
    POST_SCALE (BLOCK_K = 128, tiles on scale blocks) the tile's codes enter the dot as they are (exact in
    x's dtype) and its float32 partial is scaled per column before it is added (`_dot_tile`). W_INT4: W is
    int4 words [N, cdiv(K, 8)] with group scales s [N, K / GROUP] (zero points z, HAS_ZERO), read a tile
    of BLOCK_K // 8 word rows at a time (int4_tiles.int4_dot, INT4_SLABS its form; no PRELOAD)."""
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    m_blocks = tl.cdiv(M, BLOCK_M)
    pid_m = pid % m_blocks
    pid_n = pid // m_blocks
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    mask_m = rm[:, None] < M
    if MIX_N > 0:
        # NOTE: a tile's columns are the MIX_N streams of BLOCK_N // MIX_N hidden positions (column c is
        # stream c % MIX_N of position c // MIX_N): the weight rows a tile reads are gathered either way,
        # and an element's dot never depends on its place in the tile, so the logits are the plain GEMV's
        h_col = pid_n * (BLOCK_N // MIX_N) + tl.arange(0, BLOCK_N) // MIX_N
        rn = (tl.arange(0, BLOCK_N) % MIX_N) * MIX_H + h_col
        col_ok = h_col < MIX_H
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = rn < N
    mask_n = col_ok[None, :]
    if W_INT4:  # NOTE: BLOCK_K // 8 rows of words (k_lo is a multiple of BLOCK_K, so of 8)
        w_ptrs = (
            w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k_lo // 8 + tl.arange(0, BLOCK_K // 8))[:, None]
        )
    else:
        w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k_lo + rk)[:, None]
    if W_FP8:
        s_rows = s_ptr + (rn // 128) * stride_sn  # [BLOCK_N] each column's row of scales
    elif W_INT4:
        s_rows = s_ptr + rn.to(tl.int64) * stride_sn  # [BLOCK_N] each column's row of group scales
    else:
        s_rows = w_ptr  # unused
    ty = x_ptr.dtype.element_ty
    # NOTE: the split's first PRELOAD (<= 4) weight tiles are loaded before the PDL wait: no kernel writes
    # weights, so these loads may overlap the previous kernel (common.py's NOTE), and after the wait only
    # x is fetched for them. They enter the dot exactly as the loop's tiles do (same tiles, same order).
    POST: tl.constexpr = W_FP8 and POST_SCALE
    # NOTE: a short FP8 split (<= PRELOAD_TILES tiles: K <= 512, or many splits; none of the released
    # model's FP8 shapes) preloads all its tiles dequantized per weight (ops/fp8.py's roundings), as
    # `post_scale=False` does, and scales no partial. Scaling them instead made the small preset's FP8
    # engine (K = 256) part from the dequantized checkpoint's within 8 tokens (tests/gpu/test_fp8_engine.py,
    # BENCHMARKS.md, Decode). Either way the rule is a function of (N, K, dtype): rows stay invariant.
    if PRELOAD > 0:
        w0 = _weight_tile(w_ptrs, mask_n, k_lo, rk, k_hi, W_FP8, s_rows, col_ok, K_BLOCKS, ty)
    if PRELOAD > 1:
        w1 = _weight_tile(
            w_ptrs + BLOCK_K, mask_n, k_lo + BLOCK_K, rk, k_hi, W_FP8, s_rows, col_ok, K_BLOCKS, ty
        )
    if PRELOAD > 2:
        w2 = _weight_tile(
            w_ptrs + 2 * BLOCK_K, mask_n, k_lo + 2 * BLOCK_K, rk, k_hi, W_FP8, s_rows, col_ok, K_BLOCKS, ty
        )
    if PRELOAD > 3:
        w3 = _weight_tile(
            w_ptrs + 3 * BLOCK_K, mask_n, k_lo + 3 * BLOCK_K, rk, k_hi, W_FP8, s_rows, col_ok, K_BLOCKS, ty
        )
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k_lo + rk)[None, :]
    pdl_start(PDL)
    if MIX_N > 0:  # issued before the K loop, used after it
        mix_x = tl.load(
            mix_x_ptr + rm[:, None].to(tl.int64) * stride_mx + rn[None, :], mask=mask_m & mask_n, other=0.0
        )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PRELOAD > 0:
        acc = _dot_tile(acc, x_ptrs, w0, mask_m, k_lo + rk, k_hi, IEEE)
    if PRELOAD > 1:
        acc = _dot_tile(acc, x_ptrs + BLOCK_K, w1, mask_m, k_lo + BLOCK_K + rk, k_hi, IEEE)
    if PRELOAD > 2:
        acc = _dot_tile(acc, x_ptrs + 2 * BLOCK_K, w2, mask_m, k_lo + 2 * BLOCK_K + rk, k_hi, IEEE)
    if PRELOAD > 3:
        acc = _dot_tile(acc, x_ptrs + 3 * BLOCK_K, w3, mask_m, k_lo + 3 * BLOCK_K + rk, k_hi, IEEE)
    x_ptrs += PRELOAD * BLOCK_K
    w_ptrs += PRELOAD * BLOCK_K
    if W_INT4:
        x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1]
        z_rows = z_ptr + rn.to(tl.int64) * stride_sn
        word_k = k_lo + tl.arange(0, BLOCK_K // 8) * 8  # each word row's first K column, in this tile
        for k0 in range(k_lo, k_hi, BLOCK_K):
            words = tl.load(w_ptrs, mask=mask_n & (word_k[:, None] < k_hi), other=0)
            if IEEE:
                acc = int4_dot(
                    acc, x_rows, mask_m, words, s_rows, z_rows, col_ok, k0, k_hi, ty, GROUP, BLOCK_K,
                    HAS_ZERO, "ieee", INT4_SLABS,
                )  # fmt: skip
            else:
                acc = int4_dot(
                    acc, x_rows, mask_m, words, s_rows, z_rows, col_ok, k0, k_hi, ty, GROUP, BLOCK_K,
                    HAS_ZERO, "tf32", INT4_SLABS,
                )  # fmt: skip
            w_ptrs += BLOCK_K // 8
            word_k += BLOCK_K
    else:
        for k0 in range(k_lo + PRELOAD * BLOCK_K, k_hi, BLOCK_K):
            w = _weight_tile(
                w_ptrs, mask_n, k0, rk, k_hi, W_FP8, s_rows, col_ok, K_BLOCKS, ty, POST, FAST_FP8
            )
            c = _tile_scale(s_rows, k0, col_ok, POST)
            acc = _dot_tile(acc, x_ptrs, w, mask_m, k0 + rk, k_hi, IEEE, c, POST)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    if SPLIT:
        MN = M.to(tl.int64) * N
        tl.store(ws_ptr + pid_s.to(tl.int64) * MN + offs, acc, mask=mask_m & mask_n)
        if FIXUP:
            S = tl.num_programs(1)
            tl.debug_barrier()  # every thread's partial is stored before the release below
            arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
            tl.debug_barrier()
            if arrived == S - 1:  # the last of the tile's splits: add them all in split order
                tot = tl.load(ws_ptr + offs, mask=mask_m & mask_n, other=0.0, cache_modifier=".cg")
                for s in range(1, S):
                    tot += tl.load(
                        ws_ptr + s * MN + offs, mask=mask_m & mask_n, other=0.0, cache_modifier=".cg"
                    )
                y = _epilogue(tot, rn[None, :], out_ptr.dtype.element_ty, SILU_COLS, silu_scale)
                tl.store(out_ptr + offs, y, mask=mask_m & mask_n)
                tl.atomic_xchg(cnt_ptr + pid, 0)
    elif MIX_N > 0:
        ty = out_ptr.dtype.element_ty
        u = _mix_epilogue(acc, mix_x, ty, BLOCK_M, BLOCK_N, MIX_N, mix_inv_n)
        h = pid_n * (BLOCK_N // MIX_N) + tl.arange(0, BLOCK_N // MIX_N)
        u_offs = rm[:, None].to(tl.int64) * MIX_H + h[None, :]
        tl.store(out_ptr + u_offs, u, mask=mask_m & (h[None, :] < MIX_H))
    else:
        y = _epilogue(acc, rn[None, :], out_ptr.dtype.element_ty, SILU_COLS, silu_scale)
        tl.store(out_ptr + offs, y, mask=mask_m & mask_n)


@triton.jit
def _weight_tile(
    w_ptrs, mask_n, k0, rk, k_hi, W_FP8: tl.constexpr, s_rows, col_ok, K_BLOCKS, ty: tl.constexpr,
    POST: tl.constexpr = False, FAST: tl.constexpr = False,
):  # fmt: skip
    """The [BLOCK_K, BLOCK_N] weight tile at w_ptrs (its K columns k0 + rk), zeros past k_hi. FP8: each
    value times its 128 x 128 block's scale in float32, rounded to ty (ops/fp8.py dequantize's roundings),
    from the two scale columns a tile of up to 256 K columns starting on a multiple of BLOCK_K can touch;
    with POST the codes only, in ty (exact: every E4M3 value is a 16-bit float; FAST: by bit moves,
    common.fp8_codes), scaled after the dot."""
    kk = k0 + rk
    w = tl.load(w_ptrs, mask=mask_n & (kk[:, None] < k_hi), other=0.0)
    if POST:
        w = fp8_codes(w, ty, FAST)
    elif W_FP8:
        kb = k0 // 128
        s0 = tl.load(s_rows + kb, mask=col_ok, other=0.0)  # [BLOCK_N]
        s1 = tl.load(s_rows + tl.minimum(kb + 1, K_BLOCKS - 1), mask=col_ok, other=0.0)  # (past K: unused)
        s = tl.where((kk // 128 == kb)[:, None], s0[None, :], s1[None, :])
        w = (w.to(tl.float32) * s).to(ty)
    return w


@triton.jit
def _tile_scale(s_rows, k0, col_ok, POST: tl.constexpr):
    """With POST: the [BLOCK_N] scales of the tile at K column k0 (one scale block: BLOCK_K = 128)."""
    s = tl.where(col_ok, 0.0, 0.0)  # one return type either way (unused without POST)
    if POST:
        s = tl.load(s_rows + k0 // 128, mask=col_ok, other=0.0)
    return s


@triton.jit
def _dot_tile(acc, x_ptrs, w, mask_m, kk, k_hi, IEEE: tl.constexpr, scale=0.0, POST: tl.constexpr = False):
    """acc + x[rows, kk] @ w, x's columns past k_hi zeros; with POST the tile's float32 partial times its
    columns' scales first (the tile lies in one scale block)."""
    x = tl.load(x_ptrs, mask=mask_m & (kk[None, :] < k_hi), other=0.0)
    if IEEE:
        part = tl.dot(x, w, input_precision="ieee")
    else:
        part = tl.dot(x, w)
    if POST:
        return acc + part * scale[None, :]
    return acc + part


@triton.jit
def _mix_epilogue(
    acc, mix_x, ty: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_S: tl.constexpr, inv_n
):
    """u [BLOCK_M, BLOCK_N // N_S] = mean over the streams of sigmoid(logits) * x, from the float32 logits
    acc and x [BLOCK_M, BLOCK_N] (column c: stream c % N_S), with hyper.py's _mix_streams roundings: the
    logits and each sigmoid rounded to ty, each product rounded to ty, the streams added in order s = 0,
    1, ... in float32 (a where-sum picks stream s exactly), the mean rounded once (the same bits in 16-bit
    dtypes, where the product's rounding keeps it apart from the sum)."""
    g = sigmoid(acc.to(ty).to(tl.float32)).to(ty).to(tl.float32)
    p = tl.reshape((g * mix_x.to(tl.float32)).to(ty).to(tl.float32), (BLOCK_M, BLOCK_N // N_S, N_S))
    stream = tl.arange(0, N_S)[None, None, :]
    u = tl.zeros((BLOCK_M, BLOCK_N // N_S), dtype=tl.float32)
    for s in tl.static_range(N_S):
        u += tl.sum(tl.where(stream == s, p, 0.0), axis=2)
    return (u * inv_n).to(ty)


@triton.jit
def _epilogue(acc, cols, ty: tl.constexpr, SILU_COLS: tl.constexpr, silu_scale):
    """acc (float32) rounded to ty; columns below SILU_COLS then silu(y * silu_scale), each op rounded
    to ty as ops/hyper.scaled_silu does on the stored y (the same bits as that second launch)."""
    y = acc.to(ty)
    if SILU_COLS > 0:
        v = (y.to(tl.float32) * silu_scale).to(ty).to(tl.float32)
        y = tl.where(cols < SILU_COLS, (v / (1.0 + tl.exp(-v))).to(ty), y)
    return y


@triton.jit(do_not_specialize=["MN"])
def _sum_splits(
    ws_ptr, y_ptr, MN, N, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    SILU_COLS: tl.constexpr = 0, silu_scale=1.0,
):  # fmt: skip
    """y[i] = ((ws[0, i] + ws[1, i]) + ws[2, i]) + ... in float32, rounded once to y's dtype (and the
    columns below SILU_COLS through `_epilogue`)."""
    pdl_start(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):  # unrolled: all loads in flight, the adds in split order
        acc += tl.load(ws_ptr + s * MN.to(tl.int64) + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, _epilogue(acc, offs % N, y_ptr.dtype.element_ty, SILU_COLS, silu_scale), mask=mask)


def small_m_linear(
    x: torch.Tensor,
    weight: torch.Tensor | Fp8Weight | Int4Weight,
    block_n: int | None = None,
    block_k: int | None = None,
    *,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    block_m: int | None = None,
    one_launch: bool = True,
    silu_cols: int = 0,
    silu_scale: float = 1.0,
    preload: bool | None = None,
    post_scale: bool = True,
    int4_slabs: bool | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] (CUDA, any M), row-invariant, free of host reads (CUDA-graph
    capturable); accumulates in float32. The configuration is `gemv_config(N, K, dtype, fp8)` unless
    overridden (for tuning): it is part of the numerics, a row's bits being fixed for a given configuration.
    `splits` asks for about that many K splits (rounded so that no split is empty); `block_m` overrides
    the rows per program (16, or 32 when M > 16) for the benchmark's check that both give the same bits;
    `one_launch=False` adds the K splits in a second kernel (the same bits; for tests and the benchmark).
    `silu_cols` > 0: output columns below it are silu(y * silu_scale), rounded as `scaled_silu` rounds
    (the hyper-connections' down projection and its activation in one launch; the same bits).
    `preload=False` loads no weight tile before the PDL wait (the same bits; for the benchmark).
    `post_scale=False` runs an FP8 weight as a dequantized tile in the 16-bit configuration instead (the
    path before POST_SCALE, kept for the benchmark's side by side). An int4 weight (ops/int4.py) runs its own
    configuration (`gemv_config(..., int4=True)`), each tile dequantized in registers; `int4_slabs` picks
    int4_tiles.int4_dot's form (None: gemv_config.INT4_SLABS; either is row-invariant; for the benchmark)."""
    x = unit_stride(x)  # a column slice (the mixer's activation next to the inject logits) read in place
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape[1] == K, (x.shape, weight.shape)
    weight, fp8 = _weight_args(weight, x, post_scale)
    cfg = _config(N, K, x.dtype, fp8)
    bn = block_n or cfg.block_n
    bk = block_k or cfg.block_k
    if splits is None and (bn, bk) == (cfg.block_n, cfg.block_k):
        s, tiles = cfg.splits, cfg.split_tiles
    else:
        s, tiles = k_splits(N, K, bn, bk, want=splits)
    warps, stages = num_warps or cfg.num_warps, num_stages or cfg.num_stages
    assert not fp8 or bk <= 256, "an FP8 tile spans at most two 128-column scale blocks"
    assert not fp8.get("POST_SCALE") or bk == FP8_BLOCK_K, "a post-scaled FP8 tile is one scale block"
    if fp8.get("W_INT4"):
        fp8["INT4_SLABS"] = fp8["INT4_SLABS"] if int4_slabs is None else int4_slabs
        check_block_k(bk, fp8["INT4_SLABS"])
    pre = preload_tiles(tiles) if preload is not False and not fp8.get("W_INT4") else 0
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    ws = y if s == 1 else torch.empty((s, M, N), dtype=torch.float32, device=x.device)
    block_m = block_m or (BLOCK_M if M <= BLOCK_M else 2 * BLOCK_M)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, bn), s)
    pdl = launch_pdl(x)
    cnt = tile_counters(x.device) if s > 1 and one_launch and grid[0] <= COUNTERS else None
    fixup = cnt is not None
    _small_m_gemm[grid](
        x, weight, y, ws, cnt if fixup else ws, M, N, K, tiles * bk, x.stride(0), weight.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, SPLIT=s > 1, FIXUP=fixup, IEEE=x.dtype == torch.float32,
        PDL=pdl, PRELOAD=pre, SILU_COLS=silu_cols, silu_scale=silu_scale, num_warps=warps, num_stages=stages,
        launch_pdl=pdl, **fp8,
    )  # fmt: skip
    if s > 1 and not fixup:
        _sum_splits[(triton.cdiv(M * N, REDUCE_BLOCK),)](
            ws, y, M * N, N, SPLITS=s, BLOCK=REDUCE_BLOCK, PDL=pdl, SILU_COLS=silu_cols,
            silu_scale=silu_scale, launch_pdl=pdl,
        )  # fmt: skip
    return y


def small_m_linear_mix(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight | Int4Weight, xn: torch.Tensor, n: int, hidden: int
) -> torch.Tensor | None:
    """u [M, hidden] = the stream mix (ops/hyper.py mix_streams, sigmoid gates) of xn [M, n*hidden] by the
    logits x [M, K] @ weight[n*hidden, K]^T, in one launch: the hyper-connections' up projection and mix,
    with the bits of small_m_linear then triton_mix_streams in 16-bit dtypes (in float32 the compiler may
    contract a product and its sum into one FMA in either kernel: equal to rounding). Rows are invariant
    as the GEMV's are. None where the weight's configuration does not allow it (K split, or a tile not a
    whole number of positions' streams)."""
    x = unit_stride(x)
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape[1] == K, (x.shape, weight.shape)
    (weight, fp8), xn = _weight_args(weight, x), unit_stride(xn)
    cfg = _config(N, K, x.dtype, fp8)
    if N != n * hidden or cfg.splits != 1 or cfg.block_n % n or hidden % (cfg.block_n // n):
        return None
    assert xn.shape == (M, N), (x.shape, xn.shape)
    u = torch.empty((M, hidden), dtype=x.dtype, device=x.device)
    if M == 0:
        return u
    block_m = BLOCK_M if M <= BLOCK_M else 2 * BLOCK_M
    grid = (triton.cdiv(M, block_m) * (N // cfg.block_n), 1)
    pdl = launch_pdl(x)
    _small_m_gemm[grid](
        x, weight, u, u, u, M, N, K, cfg.split_tiles * cfg.block_k, x.stride(0), weight.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=False, FIXUP=False,
        IEEE=x.dtype == torch.float32, PDL=pdl, PRELOAD=cfg.preload, MIX_N=n, mix_x_ptr=xn, MIX_H=hidden,
        stride_mx=xn.stride(0), mix_inv_n=1.0 / n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        launch_pdl=pdl, **fp8,
    )  # fmt: skip
    return u


def _config(N: int, K: int, dtype: torch.dtype, args: dict):
    """The configuration of a weight whose launch keywords are `args` (`_weight_args`)."""
    return gemv_config(N, K, dtype, fp8=args.get("POST_SCALE", False), int4=args.get("W_INT4", False))


def _weight_args(
    weight: torch.Tensor | Fp8Weight | Int4Weight, x: torch.Tensor, post_scale: bool = True
) -> tuple[torch.Tensor, dict]:
    """The weight values a kernel reads and, for FP8 and int4 weights, their scale arguments.

    # NOTE: an FP8 weight runs its own configuration (`gemv_config(N, K, x.dtype, fp8=True)`): tiles of one
    # 128 x 128 scale block's columns whose codes enter the dot unscaled (exact in 16-bit floats), each
    # tile's float32 partial then times its columns' scales, as block-FP8 GEMMs do (DeepSeek's, vLLM's).
    # Rows stay invariant as the 16-bit kernel's do (the numerics are a function of (N, K, dtype) alone);
    # the results are close to the 16-bit kernel's on the dequantized weight (ops/fp8.py's reference), not
    # its bits: the scale is applied to a sum, not to each weight. It reads half the bytes of the 16-bit
    # kernel and does a multiply per column a tile instead of a dequantization per weight.
    # `post_scale=False`: the earlier form (each tile dequantized as ops/fp8.py does, in the 16-bit
    # configuration), for the benchmark."""
    if isinstance(weight, Int4Weight):
        packed, scale, zero, keys = int4_launch_args(weight)
        keys |= dict(W_INT4=True, s_ptr=scale, stride_sn=scale.stride(0), z_ptr=zero, INT4_SLABS=INT4_SLABS)
        return packed, keys
    if not isinstance(weight, Fp8Weight):
        return weight.contiguous(), {}
    q, scale = weight.q.contiguous(), weight.scale.contiguous()
    args = dict(W_FP8=True, s_ptr=scale, stride_sn=scale.stride(0), K_BLOCKS=scale.shape[1])
    fast = post_scale and x.dtype == torch.bfloat16 and fp8_bit_moves(x)  # (fp16: Triton's one cvt)
    return q, args | dict(POST_SCALE=post_scale, FAST_FP8=fast)
