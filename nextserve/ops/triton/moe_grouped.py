"""Routed experts (MoE) for CUDA as a deterministic grouped GEMM: each active expert's weights are read
once per call, however many rows use it. Four Triton kernels, no host reads, no atomics. Two entries
run the same kernels:
- `grouped_decode_experts`, decode rows: fixed blocks, row-invariant (a row's bits never depend on M
  or on the other rows). Reference: `_experts_by_row` in nextserve/ops/moe.py (per row, its experts in
  ascending id order); same contract as `routed_experts` (ops/triton/moe_decode.py), which reads an
  expert once per (row, expert) pair: at M=32 rows (320 pairs over ~240 distinct of 512 experts) that
  is ~1.3x the bytes.
- `grouped_experts`, prefill chunks: wider tiles and BLOCK_M chosen from T*k/E (`default_block_m`), so
  deterministic but not row-invariant; the pairs sorted by torch.sort (see `plan`). Reference: the
  per-expert loop `_experts_by_expert` in nextserve/ops/moe.py.

# NOTE: the design is vLLM's fused_moe without its atomics: pairs grouped by expert, blocks of at most
# BLOCK_M pairs of one expert, tl.dot grouped GEMMs, a per-row combine in ascending expert id. For
# decode:
#   0. `moe_plan.plan`: the pairs sorted by expert and cut into blocks of at most BLOCK_M pairs of one
#      expert (its NOTE: how, and why every grid is a function of the shapes alone).
#   1. `_gate_up`, program (block, I tile): a masked [BLOCK_M, BLOCK_K] gather of x rows (padding rows
#      are zeros, not loaded) times the expert's gate and up tiles (two tl.dot, float32 accumulators),
#      then silu(g) * u, stored to act [n, I] at the pairs' sorted positions.
#   2. `_down`, program (block, H tile): act rows times the expert's down tile, then y * w, stored to
#      yw [n, H] at the pair's own index r*k + s.
#   3. `_combine`, program (row, H tile): the row's k rows of yw added one at a time in ascending
#      (expert id, slot) order, chosen on the device by a running minimum over the row's keys.
# NOTE: why a row's bits never depend on M or on the other rows (C1):
# - every block size, K tiling, warp count and stage count is a fixed argument (the defaults below),
#   never chosen from M or from the routing: BLOCK_M = 16 whatever the pairs per expert;
# - a tensor-core MMA (or the float32 FMA dot) gives each output element from its own row of A and
#   column of B, by the same arithmetic at every row position of the tile: where a pair lands in its
#   block (which depends on the other rows' routing: how many pairs share its expert, and their index)
#   changes where its result is stored, not what is computed for it. Padding rows are zeros that never
#   enter a real row's sum. The K loop adds BLOCK_K tiles in ascending order into float32;
# - the act, y, y * w and combine roundings are per element, and the combine order is the row's own
#   ascending (expert id, slot), independent of the other rows and of the order the router listed them;
# - no kernel argument is the row or pair count except the plan's (`do_not_specialize`, integer work
#   only); the pointers whose alignment follows a view's offset (ids, weights) are
#   `do_not_specialize_on_alignment`, and x is copied when not 16-byte aligned, so one compiled binary
#   of each kernel serves every M. No atomics: two calls on equal inputs give equal bits.
# NOTE: prefill (`grouped_experts`) uses the same kernels with other blocks; the block sizes (BLOCK_M
# included) are part of the numerics, so its bits are fixed for a given T, not row by row. At 64
# tokens or more a chunk touches most of the 512 experts (5 GB of bf16 a layer): the call is bound by
# reading each active expert's weights once (about 1 ms on an H200), so its tiles are wider (gate/up
# 64 x 64, down 128 x 64) and BLOCK_M follows the mean pairs per expert (16 to 128; at 128, 8 warps,
# gate/up tiles 128 wide and down tiles 256 wide): a smaller BLOCK_M only saves MMA work on the mostly
# empty blocks.
# Prefill launches a block's N tiles next to each other (`n_fast`, grid (tiles, blocks)), so that a block's
# rows are likely still in L2 when its next tile reads them (with blocks first, every block's rows were
# gathered again for each tile, a wave of blocks later; the L2 traffic itself was not measured). Four
# 4,096-token chunks' bf16 experts took 4,182 us against 4,511, a 1,024-token chunk's 1,318 against 1,431
# (H200).
# benchmarks/bench_kernels.py moe_prefill and moe_together sweep them.
# NOTE: speed at the real sizes (H=2560, I=640, E=512, k=10, bf16: 9.8 MB of weights an expert) on an
# H200. Decode is bound by streaming the distinct experts' weights (M=1: 10 experts, 98 MB; M=32: ~240
# experts, 2.4 GB); a block holds 1.0-1.4 real pairs on average at M <= 32, so the MMA rows are mostly
# padding and cost nothing that matters. The blocks aim at many weight bytes in flight with enough
# programs at M=1: gate/up tiles of 32 x 128 (2 x 8 KB a stage, 4 stages; 10 x 20 = 200 programs at
# M=1), down tiles of 64 x 128 (16 KB a stage; 10 x 40 = 400 programs at M=1). FP8 weights at one row
# run 8 stages (`decode_stages`).
# benchmarks/bench_kernels.py moe_grouped_decode compares decode with routed_experts and sweeps the blocks.
# NOTE: the roundings follow the reference: gate and up rounded to the model dtype (as F.linear's
# output is), silu and the product rounded to it, y rounded to it, y * w rounded to it, then
# out = out + y * w rounded to it after each expert. Only the order inside each dot differs (float32
# accumulation), so outputs match the reference to a tolerance, not bit for bit; nor are they
# routed_experts' bits (another dot order). float32 inputs use IEEE dots (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..cached_experts import CachedExperts, parts
from ..fp8 import Fp8Weight
from ..int4 import Int4Weight
from ..moe import default_block_m
from .common import pdl_args, pdl_start
from .fp8_gemm import fp8_mma_rows, quantize_activations
from .int4_tiles import check_block_k, int4_dot, int4_launch_args
from .moe_decode import expert_shapes
from .moe_plan import BLOCK_M, plan

_GRID_Y_MAX = 65535  # a CUDA grid's second axis
STAGES = 4  # the pipeline depth of the 16-bit kernels, and of FP8 ones past FP8_DEEP_ROWS decode rows
# NOTE: the depth sets when weight tiles are fetched, never the order they are added, so a row's bits do
# not depend on it and it may follow M. An FP8 stage carries half a 16-bit stage's weight bytes; at one
# row (11 blocks: 220 gate/up and 440 down programs) 8 stages cut the FP8 graph replay from 1.46 to 1.34 ms
# at 8 layers and from 7.03 to 6.27 ms at 48; at 2 rows they were even, at 8 rows (fewer programs fit an
# SM) 14% slower. 16-bit weights at 6 or 8 stages gained nothing (BENCHMARKS.md, Decode).
FP8_DEEP_STAGES = 8
FP8_DEEP_ROWS = 1
# NOTE: Triton holds (num_stages - 1) tiles of A and B in shared memory; float32 tiles of the wide prefill
# blocks (128 x 64 and 64 x 256) at 4 stages asked for 288 KB, past an H200 SM's 227 KB, so the depth is
# capped where a stage is that big (no 16-bit or FP8 configuration is). It is also capped at the K loop's
# tile count: the FP8 decode `_down` (I = 640: 5 tiles) ran 8 stages, whose unfilled buffers kept programs
# off the SMs; at 5 its eager time at one row fell from 0.100 to 0.084 ms over 8 layers (BENCHMARKS.md,
# Decode).
TILE_BUDGET = 160 * 1024  # shared memory bytes of pipelined tiles a program may hold
# NOTE: int4 weights: decode runs int4_tiles.int4_dot's eight slab dots (the codes into the MMA, a tile's
# sum scaled once per column): a layer's experts at 1 / 8 / 32 rows took 36.4 / 170.1 / 488.3 us against
# 48.8 / 255.8 / 785.0 with each tile dequantized in K order (H100, one call; BENCHMARKS.md, W4A16).
# Prefill chunks (blocks of up to 128 rows) dequantize each tile in K order into one dot, K tiles of 64:
# the 48-layer int4 build prefilled 8,192 tokens at 14,935 tok/s that way and at 6,894 with the slabs
# (H100; BENCHMARKS.md, W4A16).
PREFILL_INT4_SLABS = False
# NOTE: FP8 prefill experts as W8A8 (`_w8a8_dot`: x and the act rows quantized per row and 128 columns, K
# tiles of 64) are off: with them and the W8A8 projections on, a cold 62,700-token FP8 prompt took 0.814-0.857
# s against 0.626 s (H100; ops/triton/fp8_gemm.py's NOTE), while the projections alone ran faster at the
# kernel level; the experts' tiles were not tuned for FP8 operands.
PREFILL_EXPERTS_W8A8 = False


def _fit(stages: int, stage_bytes: int, k_tiles: int) -> int:
    """`stages`, or fewer (at least 2) where its tiles would pass TILE_BUDGET or outnumber the K loop's
    k_tiles (buffers no tile fills only keep programs off an SM)."""
    return max(2, min(stages, k_tiles, 1 + TILE_BUDGET // stage_bytes))


@triton.jit
def _fp8_tile(w, s_rows, k0, ty: tl.constexpr):
    """An FP8 weight tile [BLOCK_K, BLOCK_N] (its K columns k0.., inside one 128-column scale block) times
    its columns' scales (s_rows [BLOCK_N]: each column's row of the expert's scales), rounded to ty: the
    roundings of ops/fp8.py dequantize."""
    s = tl.load(s_rows + k0 // 128)
    return (w.to(tl.float32) * s[None, :]).to(ty)


@triton.jit
def _w8a8_dot(acc, a, w, sa, s_rows, mask_n, k0):
    """acc + (E4M3 codes a [BLOCK_M, BLOCK_K] · w [BLOCK_K, BLOCK_N]) in float32, times the rows' scales sa
    [BLOCK_M] and the columns' scales of this K block (s_rows [BLOCK_N], as `_fp8_tile`): the scheme of
    ops/triton/fp8_gemm.py (each K tile inside one 128-column scale block)."""
    sw = tl.load(s_rows + k0 // 128, mask=mask_n, other=0.0)
    return acc + tl.dot(a, w, out_dtype=tl.float32) * sa[:, None] * sw[None, :]


@triton.jit
def _block_and_tile(N_FAST: tl.constexpr):
    """(block, N tile) of this program: grid (blocks, tiles), or (tiles, blocks) with N_FAST, where the
    programs next to each other in launch order are one block's tiles (its rows read close together in
    time) and then the same expert's next block (its weights read close together in time)."""
    if N_FAST:
        return tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _int4_gate_up(
    acc_g, acc_u, a_rows, mask_m, base, rn, mask_n, H, I, stride_n, s_base, z_base, stride_s_r,
    ty: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, SLABS: tl.constexpr,
):  # fmt: skip
    """`_gate_up`'s K loop over int4 words (base: the expert's words, s_base and z_base its scales and zero
    points): a tile of BLOCK_K // 8 word rows of the gate and up rows at a time."""
    rkw = tl.arange(0, BLOCK_K // 8)
    g_ptrs = base + rn[None, :] * stride_n + rkw[:, None]  # [BK // 8, BN]
    u_ptrs = g_ptrs + I * stride_n
    gs_rows, gz_rows = s_base + rn * stride_s_r, z_base + rn * stride_s_r  # [BN] each column's groups
    us_rows, uz_rows = gs_rows + I * stride_s_r, gz_rows + I * stride_s_r
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            wm = mask_n[None, :]
        else:
            wm = mask_n[None, :] & ((k0 + rkw * 8) < H)[:, None]
        wg = tl.load(g_ptrs, mask=wm, other=0)
        wu = tl.load(u_ptrs, mask=wm, other=0)
        acc_g = int4_dot(
            acc_g, a_rows, mask_m[:, None], wg, gs_rows, gz_rows, mask_n, k0, H, ty, GROUP, BLOCK_K, HAS_ZERO,
            PRECISION, SLABS,
        )  # fmt: skip
        acc_u = int4_dot(
            acc_u, a_rows, mask_m[:, None], wu, us_rows, uz_rows, mask_n, k0, H, ty, GROUP, BLOCK_K, HAS_ZERO,
            PRECISION, SLABS,
        )  # fmt: skip
        g_ptrs += BLOCK_K // 8
        u_ptrs += BLOCK_K // 8
    return acc_g, acc_u


@triton.jit
def _int4_down(
    acc, a_rows, mask_m, base, rn, mask_n, I, stride_n, s_base, z_base, stride_s_r,
    ty: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, SLABS: tl.constexpr,
):  # fmt: skip
    """`_down`'s K loop over int4 words, as `_int4_gate_up`."""
    rkw = tl.arange(0, BLOCK_K // 8)
    d_ptrs = base + rn[None, :] * stride_n + rkw[:, None]  # [BK // 8, BN]
    s_rows = s_base + rn * stride_s_r
    z_rows = z_base + rn * stride_s_r
    for k0 in range(0, I, BLOCK_K):
        wd = tl.load(d_ptrs, mask=mask_n[None, :] & ((k0 + rkw * 8) < I)[:, None], other=0)
        acc = int4_dot(
            acc, a_rows, mask_m[:, None], wd, s_rows, z_rows, mask_n, k0, I, ty, GROUP, BLOCK_K, HAS_ZERO,
            PRECISION, SLABS,
        )  # fmt: skip
        d_ptrs += BLOCK_K // 8
    return acc


@triton.jit
def _expert_bases(
    e, E_SHARED, w_ptr, sw_ptr, stride_e, s_ptr, ss_ptr, z_ptr, sz_ptr, stride_s_e,
    slot_ptr, cw_ptr, cs_ptr, cz_ptr, SCALED: tl.constexpr, ZEROS: tl.constexpr, CACHED: tl.constexpr,
):  # fmt: skip
    """Where expert e's values, scales (SCALED) and zero points (ZEROS) start: the shared expert's at sw_ptr,
    ss_ptr, sz_ptr when e == E_SHARED; with CACHED, those of cache slot slot[e] (at cw_ptr, cs_ptr, cz_ptr,
    with the routed experts' strides) when it has one; else the routed stacks' expert e. Parts a format
    lacks come back as the values' base (unread)."""
    base = tl.where(e == E_SHARED, sw_ptr, w_ptr + e.to(tl.int64) * stride_e)
    s_base, z_base = base, base
    if SCALED:
        s_base = tl.where(e == E_SHARED, ss_ptr, s_ptr + e.to(tl.int64) * stride_s_e)
    if ZEROS:
        z_base = tl.where(e == E_SHARED, sz_ptr, z_ptr + e.to(tl.int64) * stride_s_e)
    if CACHED:
        # NOTE: the shared expert never has a slot (its table entry is not loaded)
        c = tl.load(slot_ptr + e, mask=e != E_SHARED, other=-1).to(tl.int64)
        base = tl.where(c >= 0, cw_ptr + c * stride_e, base)
        if SCALED:
            s_base = tl.where(c >= 0, cs_ptr + c * stride_s_e, s_base)
        if ZEROS:
            z_base = tl.where(c >= 0, cz_ptr + c * stride_s_e, z_base)
    return base, s_base, z_base


@triton.jit
def _gate_up(
    x_ptr, order_ptr, blk_e_ptr, blk_lo_ptr, blk_hi_ptr, gu_ptr, sgu_ptr, act_ptr, H, I, E_SHARED,
    stride_gu_e, stride_gu_n,
    K_TOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
    W_FP8: tl.constexpr = False, gus_ptr=None, sgus_ptr=None, stride_gus_e=0, stride_gus_r=0,
    N_FAST: tl.constexpr = False,
    W_INT4: tl.constexpr = False, guz_ptr=None, sguz_ptr=None, GROUP: tl.constexpr = 1,
    HAS_ZERO: tl.constexpr = False, INT4_SLABS: tl.constexpr = True,
    CACHED: tl.constexpr = False, slot_ptr=None, cgu_ptr=None, cgus_ptr=None, cguz_ptr=None,
    A_FP8: tl.constexpr = False, xs_ptr=None, stride_xs=0,
):  # fmt: skip
    """act[p] = silu(gate_e · x[row]) * (up_e · x[row]) for the block's sorted pairs p (of expert e);
    program (block, I tile). x is [M, H] with rows H apart; expert E_SHARED's weights are at sgu_ptr
    (the shared expert; -1: none). W_FP8: the weights are float8_e4m3fn, with float32 scales [E, 2I/128,
    cdiv(H, 128)] at gus_ptr (the shared expert's at sgus_ptr), each tile dequantized in registers. W_INT4:
    int4 words [E, 2I, H / 8] with group scales [E, 2I, H / GROUP] at gus_ptr (zero points at guz_ptr; the
    shared expert's at sgus_ptr, sguz_ptr), a tile of BLOCK_K // 8 word rows at a time (int4_dot). CACHED:
    expert e's values, scales and zero points from cache slot slot[e] (at cgu_ptr, cgus_ptr, cguz_ptr, with
    the routed experts' strides) when it has one (`_expert_bases`). A_FP8 (with W_FP8): x is E4M3 codes
    with float32 scales [M, H / 128] at xs_ptr, each K tile's FP8 dot scaled by its rows' and columns'
    scales (W8A8, `_w8a8_dot`)."""
    pdl_start(PDL)
    pid_b, pid_n = _block_and_tile(N_FAST)
    e = tl.load(blk_e_ptr + pid_b)
    if e < 0:
        return
    lo = tl.load(blk_lo_ptr + pid_b)
    hi = tl.load(blk_hi_ptr + pid_b)
    rows = lo + tl.arange(0, BLOCK_M)
    mask_m = rows < hi
    pair = tl.load(order_ptr + rows, mask=mask_m, other=0)
    tok = (pair // K_TOP).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < I
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * H + rk[None, :]  # [BLOCK_M, BLOCK_K]
    base, s_base, z_base = _expert_bases(
        e, E_SHARED, gu_ptr, sgu_ptr, stride_gu_e, gus_ptr, sgus_ptr, guz_ptr, sguz_ptr, stride_gus_e,
        slot_ptr, cgu_ptr, cgus_ptr, cguz_ptr, W_FP8 or W_INT4, W_INT4, CACHED,
    )  # fmt: skip
    g_ptrs = base + rn[None, :] * stride_gu_n + rk[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + I * stride_gu_n
    ty = x_ptr.dtype.element_ty
    if W_FP8:
        gs_rows = s_base + (rn // 128) * stride_gus_r  # [BN] (I is a multiple of 128: up rows follow)
        us_rows = s_base + ((rn + I) // 128) * stride_gus_r
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if W_INT4:
        acc_g, acc_u = _int4_gate_up(
            acc_g, acc_u, x_ptr + tok[:, None] * H, mask_m, base, rn, mask_n, H, I, stride_gu_n, s_base,
            z_base, stride_gus_r, ty, GROUP, HAS_ZERO, BLOCK_K, EVEN_K, DOT_PRECISION, INT4_SLABS,
        )  # fmt: skip
    else:
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                if EVEN_N:
                    wg = tl.load(g_ptrs)
                    wu = tl.load(u_ptrs)
                else:
                    wg = tl.load(g_ptrs, mask=mask_n[None, :], other=0.0)
                    wu = tl.load(u_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                mask_k = (k0 + rk) < H
                a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                wg = tl.load(g_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                wu = tl.load(u_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if A_FP8:
                sa = tl.load(xs_ptr + tok * stride_xs + k0 // 128, mask=mask_m, other=0.0)
                acc_g = _w8a8_dot(acc_g, a, wg, sa, gs_rows, mask_n, k0)
                acc_u = _w8a8_dot(acc_u, a, wu, sa, us_rows, mask_n, k0)
            else:
                if W_FP8:
                    wg = _fp8_tile(wg, gs_rows, k0, ty)
                    wu = _fp8_tile(wu, us_rows, k0, ty)
                acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
                acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    dt = act_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    act = (silu * u).to(dt)
    tl.store(
        act_ptr + rows[:, None].to(tl.int64) * I + rn[None, :], act, mask=mask_m[:, None] & mask_n[None, :]
    )


@triton.jit(do_not_specialize_on_alignment=["w_ptr"])
def _down(
    act_ptr, order_ptr, w_ptr, blk_e_ptr, blk_lo_ptr, blk_hi_ptr, down_ptr, sdown_ptr, yw_ptr, H, I,
    E_SHARED, stride_d_e, stride_d_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
    W_FP8: tl.constexpr = False, ds_ptr=None, sds_ptr=None, stride_ds_e=0, stride_ds_r=0,
    N_FAST: tl.constexpr = False,
    W_INT4: tl.constexpr = False, dz_ptr=None, sdz_ptr=None, GROUP: tl.constexpr = 1,
    HAS_ZERO: tl.constexpr = False, INT4_SLABS: tl.constexpr = True,
    CACHED: tl.constexpr = False, slot_ptr=None, cdown_ptr=None, cds_ptr=None, cdz_ptr=None,
    A_FP8: tl.constexpr = False, xs_ptr=None, stride_xs=0,
):  # fmt: skip
    """yw[pair] = w[pair] * (down_e · act[p]) for the block's sorted pairs p; program (block, H tile).
    W_FP8: FP8 weights with float32 scales [E, cdiv(H, 128), cdiv(I, 128)] at ds_ptr (as `_gate_up`).
    W_INT4: int4 words [E, H, I / 8], group scales [E, H, I / GROUP] at ds_ptr (as `_gate_up`). CACHED: as
    `_gate_up`'s (cdown_ptr, cds_ptr, cdz_ptr). A_FP8: act is E4M3 codes with scales [n, I / 128] at xs_ptr
    (as `_gate_up`'s x)."""
    pdl_start(PDL)
    pid_b, pid_n = _block_and_tile(N_FAST)
    e = tl.load(blk_e_ptr + pid_b)
    if e < 0:
        return
    lo = tl.load(blk_lo_ptr + pid_b)
    hi = tl.load(blk_hi_ptr + pid_b)
    rows = lo + tl.arange(0, BLOCK_M)
    mask_m = rows < hi
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < H
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * I + rk[None, :]  # [BLOCK_M, BLOCK_K]
    base, s_base, z_base = _expert_bases(
        e, E_SHARED, down_ptr, sdown_ptr, stride_d_e, ds_ptr, sds_ptr, dz_ptr, sdz_ptr, stride_ds_e,
        slot_ptr, cdown_ptr, cds_ptr, cdz_ptr, W_FP8 or W_INT4, W_INT4, CACHED,
    )  # fmt: skip
    d_ptrs = base + rn[None, :] * stride_d_h + rk[:, None]  # [BK, BN]
    ty = act_ptr.dtype.element_ty
    if W_FP8:
        ds_rows = s_base + (rn // 128) * stride_ds_r  # [BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if W_INT4:
        a_rows = act_ptr + rows[:, None].to(tl.int64) * I
        acc = _int4_down(
            acc, a_rows, mask_m, base, rn, mask_n, I, stride_d_h, s_base, z_base, stride_ds_r, ty, GROUP,
            HAS_ZERO, BLOCK_K, DOT_PRECISION, INT4_SLABS,
        )  # fmt: skip
    else:
        for k0 in range(0, I, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                if EVEN_N:
                    wd = tl.load(d_ptrs)
                else:
                    wd = tl.load(d_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                mask_k = (k0 + rk) < I
                a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                wd = tl.load(d_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if A_FP8:
                sa = tl.load(xs_ptr + rows.to(tl.int64) * stride_xs + k0 // 128, mask=mask_m, other=0.0)
                acc = _w8a8_dot(acc, a, wd, sa, ds_rows, mask_n, k0)
            else:
                if W_FP8:
                    wd = _fp8_tile(wd, ds_rows, k0, ty)
                acc = tl.dot(a, wd, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            d_ptrs += BLOCK_K
    dt = yw_ptr.dtype.element_ty
    pair = tl.load(order_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    wt = tl.load(w_ptr + pair, mask=mask_m, other=0.0).to(tl.float32)
    yw = (acc.to(dt).to(tl.float32) * wt[:, None]).to(dt)
    tl.store(yw_ptr + pair[:, None] * H + rn[None, :], yw, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize_on_alignment=["ids_ptr"])
def _combine(
    yw_ptr, ids_ptr, out_ptr, H,
    K_TOP: tl.constexpr, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """out[r] = the row's k rows of yw added one at a time in ascending (expert id, slot), each add
    rounded to the model dtype; program (row, H tile)."""
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    rs = tl.arange(0, K_PAD)
    mask_s = rs < K_TOP
    e = tl.load(ids_ptr + r * K_TOP + rs, mask=mask_s, other=0).to(tl.int64)
    keys = tl.where(mask_s, e * K_PAD + rs, 9223372036854775807)
    rh = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = rh < H
    dt = out_ptr.dtype.element_ty
    out = tl.zeros((BLOCK_H,), dtype=tl.float32)
    prev = tl.min(keys) - 1
    for _ in tl.static_range(K_TOP):
        cur = tl.min(tl.where(keys > prev, keys, 9223372036854775807))
        s = cur % K_PAD
        y = tl.load(yw_ptr + (r * K_TOP + s) * H + rh, mask=mask_h, other=0.0).to(tl.float32)
        out = (out + y).to(dt).to(tl.float32)
        prev = cur
    tl.store(out_ptr + r * H + rh, out.to(dt), mask=mask_h)


def _fp8_args(w, shared_w, name: str, shared_name: str, block_k: int, split_rows: int | None):
    """(routed values, shared values, kernel keywords) of expert weights that may be FP8 (ops/fp8.py):
    their float8 values and scale pointers and strides; plain weights pass through with no keywords.

    # NOTE: the shared expert's scales are read with the routed experts' strides, like its values."""
    if not isinstance(w, Fp8Weight):
        assert not isinstance(shared_w, Fp8Weight), "FP8 shared expert with plain routed experts"
        return w, shared_w, {}
    assert isinstance(shared_w, Fp8Weight), "a plain shared expert with FP8 routed experts"
    # each tile lies in one 128-column scale block; the up rows start on a scale block (gate_up)
    assert 128 % block_k == 0 and (split_rows is None or split_rows % 128 == 0), (block_k, split_rows)
    scale, shared_scale = w.scale.contiguous(), shared_w.scale
    # (no shared expert: shared_w is w itself, a placeholder no block reads)
    assert shared_w is w or shared_scale.stride() == scale.stride()[1:], "the shared expert's scale strides"
    keys = {"W_FP8": True, f"{name}_ptr": scale, f"{shared_name}_ptr": shared_scale}
    keys |= {f"stride_{name}_e": scale.stride(0), f"stride_{name}_r": scale.stride(1)}
    return w.q.contiguous(), shared_w.q, keys


def _stage_bytes_a_weight(w, x: torch.Tensor, int4_slabs: bool) -> float:
    """Shared memory a pipeline stage holds per weight of a tile: FP8 a byte; int4 half a byte, and with the
    slabs each of its eight dots a slab converted to x's dtype, in K order with float32 rows the whole
    dequantized tile; 16-bit weights their own size.

    # NOTE: float32 rows' IEEE dot reads its dequantized weight tile from shared memory: the decode
    # gate/up at one row (16 x 128 rows of A, 2 x 32 x 128 weights, 8 stages) asked for 331,776 bytes, some
    # 4.8 a weight a stage, past an H100 SM's 232,448 (H100, GPU tests), so such a weight counts 5 bytes.
    # 16-bit rows in K order fit as counted (the prefill experts' form)."""
    if isinstance(w, Int4Weight):
        if not int4_slabs and x.element_size() == 4:
            return 1 + x.element_size()
        return 0.5 + (x.element_size() / 4 if int4_slabs else 0)
    return 1 if isinstance(w, Fp8Weight) else w.element_size()


def _int4_args(w, shared_w, name: str, shared_name: str, zero: str, shared_zero: str):
    """(routed words, shared words, kernel keywords) of int4 expert weights (ops/int4.py): the words, and
    the scale and zero-point pointers with the scales' strides (zero points have the scales' shape).

    # NOTE: the shared expert's scales and zero points are read with the routed experts' strides, like its
    # words; it must have their grouping."""
    assert isinstance(shared_w, Int4Weight), "a shared expert not in int4 with int4 routed experts"
    packed, scale, zeros, keys = int4_launch_args(w)
    if shared_w is w:  # (no shared expert: a placeholder no block reads)
        s_packed, s_scale, s_zeros = packed, scale, zeros
    else:
        s_packed, s_scale, s_zeros, s_keys = int4_launch_args(shared_w)
        assert s_keys == keys, f"the shared expert's grouping {s_keys} is not the routed experts' {keys}"
        assert s_packed.stride() == packed.stride()[1:] and s_scale.stride() == scale.stride()[1:], "strides"
    keys = keys | {"W_INT4": True, f"{name}_ptr": scale, f"{shared_name}_ptr": s_scale}
    keys |= {f"{zero}_ptr": zeros, f"{shared_zero}_ptr": s_zeros}
    keys |= {f"stride_{name}_e": scale.stride(0), f"stride_{name}_r": scale.stride(1)}
    return packed, s_packed, keys


def _cache_args(gate_up: CachedExperts, down: CachedExperts) -> tuple:
    """(host gate_up, host down, gate_up's cache keywords, down's) of experts with a device cache
    (ops/cached_experts.py): the slot table and each cache part's pointer (values, scales, zero points;
    the values stand in for parts the format lacks), read with the host experts' strides."""
    assert isinstance(down, CachedExperts) and down.slot is gate_up.slot, "gate_up and down share slots"
    keys = []
    for w, names in ((gate_up, ("cgu", "cgus", "cguz")), (down, ("cdown", "cds", "cdz"))):
        host, cache = parts(w.host), parts(w.cache)
        for h, c in zip(host, cache, strict=True):
            assert h.stride() == c.stride() and c.is_contiguous(), "a cache slot is laid out as a host expert"
        ptrs = cache + [cache[-1]] * (3 - len(cache))  # (a zero-point pointer for formats without one)
        cache_ptrs = {f"{n}_ptr": t for n, t in zip(names, ptrs, strict=True)}
        keys.append({"CACHED": True, "slot_ptr": w.slot} | cache_ptrs)
    return gate_up.host, down.host, keys[0], keys[1]


def decode_stages(rows: int, fp8: bool) -> int:
    """The decode kernels' pipeline depth for `rows` rows: FP8_DEEP_STAGES for FP8 (and int4) weights at up
    to FP8_DEEP_ROWS rows, else STAGES."""
    return FP8_DEEP_STAGES if fp8 and rows <= FP8_DEEP_ROWS else STAGES


def grouped_decode_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    block_m: int = BLOCK_M,
    block_n: int = 32,
    block_k: int = 128,
    block_n_down: int = 64,
    block_k_down: int = 128,
    warps: int = 4,
    warps_down: int = 4,
    stages: int | None = None,
    stages_down: int | None = None,
    block_h_combine: int = 256,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    int4_slabs: bool = True,
) -> torch.Tensor:
    """x [M, H]; weights [M, k] (x.dtype); ids [M, k] (int32/int64, < E, or E with `shared`: that
    expert's (gate_up [2I, H], down [H, I])); gate_up [E, 2I, H] (gate rows first); down [E, H, I].
    Returns [M, H] in x.dtype: per row, sum over its k experts taken in ascending expert id of
    w * down(silu(gate·x) * (up·x)).

    Row-invariant and free of host reads (CUDA-graph capturable), as `routed_experts`. The block sizes
    are part of the numerics: a row's bits are fixed for given blocks, whatever M and the other rows;
    they are never chosen from M or the routing. The pipeline depth (stages, stages_down; None:
    `decode_stages`) follows M, and changes no bits. A repeated id in a row is still summed, in slot
    order, as the reference does. `int4_slabs`: int4_tiles.int4_dot's form for int4 weights (a launch
    constant, never chosen from M)."""
    depth = decode_stages(x.shape[0], isinstance(gate_up, Fp8Weight | Int4Weight))
    return _grouped(
        x, weights, ids, gate_up, down, block_m, block_n, block_k, block_n_down, block_k_down,
        warps, warps_down, stages or depth, stages_down or depth, block_h_combine, sort=False, shared=shared,
        int4_slabs=int4_slabs,
    )  # fmt: skip


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    block_n_down: int | None = None,
    block_k_down: int | None = None,
    warps: int | None = None,
    warps_down: int | None = None,
    stages: int = STAGES,
    stages_down: int = STAGES,
    block_h_combine: int = 512,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    n_fast: bool = True,
    int4_slabs: bool = PREFILL_INT4_SLABS,
) -> torch.Tensor:
    """The prefill entry: x [T, H]; weights [T, k]; ids [T, k] (int32/int64, < E); gate_up [E, 2I, H]
    (gate rows first); down [E, H, I]. Returns [T, H] in x.dtype: per token, sum over its k experts
    taken in ascending expert id of w * down(silu(gate·x) * (up·x)).

    Deterministic (no atomics) and free of host reads, the kernels of `grouped_decode_experts` with
    prefill's blocks and the pairs sorted by torch.sort. block_m None picks it from T*k/E
    (`default_block_m`); block_n, block_n_down and warps None are 128, 256 and 8 with a BLOCK_M of 128,
    else 64, 128 and 4. n_fast: the programs of a block's N tiles launch next to each other (see
    `_block_and_tile`); the launch order never changes the bits. `int4_slabs`: int4_dot's form for int4
    weights (K tiles of 128 with the slabs, else 64).
    The block sizes are part of the numerics. A repeated id in a row is still summed, in slot order, as
    the reference does."""
    bm = block_m or default_block_m(ids.numel(), gate_up.shape[0])
    # NOTE: the slabs run on 16-bit rows only (`_grouped`), so float32 rows take the K-order form's K tile:
    # at 128 (the slabs' tile) a wide block of float32 rows asked for 278,528 bytes of shared memory at the
    # fewest stages, past an H100 SM's 232,448 (GPU tests)
    slabs = isinstance(gate_up, Int4Weight) and int4_slabs and x.element_size() == 2
    k_tile = 128 if slabs else 64  # (int4_tiles.check_block_k)
    block_k, block_k_down = block_k or k_tile, block_k_down or k_tile
    wide = bm >= 128
    wide_warps = 8 if wide else 4
    warps, warps_down = warps or wide_warps, warps_down or wide_warps
    block_n = block_n or (128 if wide else 64)
    block_n_down = block_n_down or (256 if wide else 128)
    return _grouped(
        x, weights, ids, gate_up, down, bm, block_n, block_k, block_n_down, block_k_down,
        warps, warps_down, stages, stages_down, block_h_combine, sort=True, shared=shared, n_fast=n_fast,
        int4_slabs=int4_slabs,
    )  # fmt: skip


def _grouped(
    x, weights, ids, gate_up, down, block_m, block_n, block_k, block_n_down, block_k_down,
    warps, warps_down, stages, stages_down, block_h_combine, sort: bool, shared=None, n_fast=False,
    int4_slabs: bool = True,
) -> torch.Tensor:  # fmt: skip
    """The four launches of both entries (sort: how `plan` orders the pairs; shared: expert E's
    weights, planned as one more expert; n_fast: grids (N tiles, blocks) while the blocks fit a grid's
    second axis; int4_slabs: int4_dot's form)."""
    gu_cache, down_cache = {}, {}
    if isinstance(gate_up, CachedExperts):
        gate_up, down, gu_cache, down_cache = _cache_args(gate_up, down)
    E = gate_up.shape[0]
    e_shared, (sgu, sdown) = (-1, (gate_up, down)) if shared is None else (E, shared)
    M, H, k, I = expert_shapes(x, weights, ids, gate_up, down)
    # NOTE: float32 rows run int4 weights in the K-order form: the slab form's eight IEEE dots asked for
    # 317 KB of shared memory in a wide prefill block (H100 limit 227 KB); its gain is on tensor cores
    int4_slabs = int4_slabs and x.element_size() == 2
    w_bytes = _stage_bytes_a_weight(gate_up, x, int4_slabs)
    if isinstance(gate_up, Int4Weight):
        check_block_k(block_k, int4_slabs), check_block_k(block_k_down, int4_slabs)
        gate_up, sgu, gu_fp8 = _int4_args(gate_up, sgu, "gus", "sgus", "guz", "sguz")
        down, sdown, down_fp8 = _int4_args(down, sdown, "ds", "sds", "dz", "sdz")
        gu_fp8["INT4_SLABS"] = down_fp8["INT4_SLABS"] = int4_slabs
    else:
        gate_up, sgu, gu_fp8 = _fp8_args(gate_up, sgu, "gus", "sgus", block_k, gate_up.shape[1] // 2)
        down, sdown, down_fp8 = _fp8_args(down, sdown, "ds", "sds", block_k_down, None)
    # NOTE: with PREFILL_EXPERTS_W8A8, prefill (sort) runs FP8 experts as W8A8 where the card has FP8 MMAs:
    # x, and the act rows before `_down`, quantized per row and 128 columns; decode rows stay 16-bit
    a_fp8 = sort and gu_fp8.get("W_FP8", False) and PREFILL_EXPERTS_W8A8 and fp8_mma_rows(x)
    a_bytes = block_m * (1 if a_fp8 else x.element_size())  # an A tile's bytes per K column
    gu_stage = int(block_k * (a_bytes + 2 * block_n * w_bytes))
    down_stage = int(block_k_down * (a_bytes + block_n_down * w_bytes))
    stages = _fit(stages, gu_stage, triton.cdiv(H, block_k))
    stages_down = _fit(stages_down, down_stage, triton.cdiv(I, block_k_down))
    if shared is not None:  # NOTE: its rows are read with the routed experts' row strides
        assert sgu.shape == gate_up.shape[1:] and sdown.shape == down.shape[1:], (sgu.shape, sdown.shape)
        assert sgu.stride() == gate_up.stride()[1:] and sdown.stride() == down.stride()[1:], "strides"
    out = torch.empty((M, H), dtype=x.dtype, device=x.device)
    n = M * k
    if n == 0:
        return out.zero_()
    # NOTE: x's rows are read H apart (a contiguous x; with one row any stride reads the same), from a
    # 16-byte aligned address (a copy otherwise), so x's alignment never selects another binary.
    x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    ids = ids.contiguous()
    weights = weights.contiguous()
    order, blk = plan(ids, E + (shared is not None), block_m, sort)
    nb = blk.shape[1]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty((n, I), dtype=x.dtype, device=x.device)
    x_rows = x
    if a_fp8:
        x_rows, xs = quantize_activations(x)
        gu_fp8 |= {"A_FP8": True, "xs_ptr": xs, "stride_xs": xs.stride(0)}
    n_fast = n_fast and nb <= _GRID_Y_MAX

    def grid(tiles: int) -> tuple[int, int]:
        return (tiles, nb) if n_fast else (nb, tiles)

    _gate_up[grid(triton.cdiv(I, block_n))](
        x_rows, order, blk[0], blk[1], blk[2], gate_up, sgu, act, H, I, e_shared, gate_up.stride(0),
        gate_up.stride(1),
        K_TOP=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=H % block_k == 0, EVEN_N=I % block_n == 0, DOT_PRECISION=precision,
        num_warps=warps, num_stages=stages, N_FAST=n_fast, **pdl_args(x), **gu_fp8, **gu_cache,
    )  # fmt: skip
    yw = torch.empty((n, H), dtype=x.dtype, device=x.device)
    if a_fp8:
        act, acts = quantize_activations(act)
        down_fp8 |= {"A_FP8": True, "xs_ptr": acts, "stride_xs": acts.stride(0)}
    _down[grid(triton.cdiv(H, block_n_down))](
        act, order, weights, blk[0], blk[1], blk[2], down, sdown, yw, H, I, e_shared, down.stride(0),
        down.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n_down, BLOCK_K=block_k_down,
        EVEN_K=I % block_k_down == 0, EVEN_N=H % block_n_down == 0, DOT_PRECISION=precision,
        num_warps=warps_down, num_stages=stages_down, N_FAST=n_fast, **pdl_args(act), **down_fp8,
        **down_cache,
    )  # fmt: skip
    _combine[(M, triton.cdiv(H, block_h_combine))](
        yw, ids, out, H, K_TOP=k, K_PAD=triton.next_power_of_2(k), BLOCK_H=block_h_combine, **pdl_args(yw),
    )  # fmt: skip
    return out
