"""QSA decode block selection for CUDA: the top `block_topk` blocks of each row's indexer scores as
token ids, without a sort. Reference: `select_decode_tokens` in nextserve/ops/attention.py (CPU path).

One program per row. A radix select on an order-preserving int32 key of each score narrows a band of
keys that holds the k-th largest, RADIX_BITS bits a pass (a histogram of the band's keys by their
next digit), and stops once the keys at or above the band are exactly k (or the band is one value).
One more pass writes the chosen blocks' tokens in ascending order, each at its slot from a running
prefix count: every key above the band, then the band's keys by ascending block up to k in all, the
stable descending sort's rule (ties to the lower block). Then the open tail and the -1 padding.

# NOTE: only the row's first n_blocks columns are read (columns past them are -inf, the sort's last
# and never kept), in large tiles then small ones, so the cost follows the row's context, not the
# scores' width M. Row invariance (C1) and CUDA graphs: a program reads one row's inputs only, the
# result is exact whatever the tiles, and B never reaches the kernel; no host reads, the output's
# shape from (B, block_topk, c) alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start

_SIGN = tl.constexpr(-(2**31))  # int32 with only the sign bit: flips between signed and unsigned order


@triton.jit
def _order_key(x):
    """Signed int32 key with the order of torch.sort on float32: -0.0 equals 0.0, NaN above +inf.
    # NOTE: on the bits only; a float compare may flush denormals to zero on the GPU (ftz)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == _SIGN, 0, bits)  # -0.0 -> +0.0 (equal, so the sort keeps index order)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negative floats: larger magnitude, lower key
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FFFFFFF, key)  # every NaN first


@triton.jit
def _band_hist(s_row, start, end, lo_s, hi_s, shift, hist, RADIX: tl.constexpr, TILE: tl.constexpr):
    """hist [RADIX] += the keys in the band [lo_s, hi_s] among columns [start, end), by the digit at
    `shift` (tiles of TILE from start)."""
    cols = tl.arange(0, TILE)
    for t in range(start, end, TILE):
        j = t + cols
        valid = j < end
        key = _order_key(tl.load(s_row + j, mask=valid, other=0.0).to(tl.float32))  # [TILE]
        digit = ((key ^ _SIGN) >> shift) & (RADIX - 1)
        hist += tl.histogram(digit, RADIX, mask=valid & (key >= lo_s) & (key <= hi_s))
    return hist


@triton.jit
def _write_chosen(
    s_row, o_row, start, end, lo_s, hi_s, need, n_gt, n_band,
    C: tl.constexpr, BLOCK_C: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """Columns [start, end): write the tokens of every key above the band and of the band's keys of
    rank < need (by column), each chosen block at its slot; n_gt / n_band: those keys before start."""
    cols = tl.arange(0, TILE)
    ci = tl.arange(0, BLOCK_C)
    for t in range(start, end, TILE):
        j = t + cols
        valid = j < end
        key = _order_key(tl.load(s_row + j, mask=valid, other=0.0).to(tl.float32))  # [TILE]
        gt = valid & (key > hi_s)
        band = valid & (key >= lo_s) & (key <= hi_s)
        # one scan for both running counts: above-band in the low 16 bits, in-band in the high ones
        packed = gt.to(tl.int32) + (band.to(tl.int32) << 16)
        before = tl.cumsum(packed, axis=0) - packed  # exclusive, within the tile
        band_rank = n_band + (before >> 16)
        chosen = gt | (band & (band_rank < need))
        slot = n_gt + (before & 0xFFFF) + tl.minimum(band_rank, need)  # chosen blocks before j
        tok = j.to(tl.int64)[:, None] * C + ci[None, :]  # [TILE, BLOCK_C]
        tl.store(o_row + slot[:, None] * C + ci[None, :], tok.to(tl.int32), mask=chosen[:, None] & (ci < C))
        total = tl.sum(packed, axis=0)
        n_gt += total & 0xFFFF
        n_band += total >> 16
    return n_gt, n_band


# NOTE: a prefill chunk's positions are a view into its forward's (at the chunk's row offset, which an odd
# chunk length before it leaves 8 bytes off a 16-byte boundary): their alignment is not specialised, so one
# binary serves every offset and none compiles at first use after the warm-up (the loads are scalars).
@triton.jit(do_not_specialize_on_alignment=["nb_ptr", "pos_ptr"])
def _select_kernel(
    s_ptr, nb_ptr, pos_ptr, out_ptr, M, k, L, stride_sb, stride_ob,
    C: tl.constexpr, BLOCK_C: tl.constexpr, RADIX_BITS: tl.constexpr,
    TILE_R: tl.constexpr, TILE_S: tl.constexpr, TILE_SMALL: tl.constexpr, TILE_L: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    nb = tl.load(nb_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    nv = tl.minimum(tl.maximum(nb, 0), M).to(tl.int32)  # candidate blocks: the valid columns
    n_pick = tl.minimum(nv, k)  # blocks chosen
    s_row = s_ptr + b * stride_sb
    o_row = out_ptr + b * stride_ob
    # whole large tiles, then small ones for the rest: a short row reads no padding to speak of
    n_big_r = nv // TILE_R * TILE_R
    n_big_s = nv // TILE_S * TILE_S

    # The band [lo, hi] of unsigned keys (key ^ SIGN; held as int32 bits): cnt_lo keys are >= lo,
    # cnt_hi are > hi. Before any pass it is every key; with nv <= k that is the answer already.
    lo = tl.zeros([], dtype=tl.int32)
    hi = tl.full([], -1, dtype=tl.int32)
    cnt_lo = nv
    cnt_hi = tl.zeros([], dtype=tl.int32)
    if nv > k:
        RADIX: tl.constexpr = 1 << RADIX_BITS
        digits = tl.arange(0, RADIX)
        for p in range((32 + RADIX_BITS - 1) // RADIX_BITS):
            if cnt_lo > k:  # else the band holds exactly the keys still missing: done
                # the last digit may overlap bits already fixed: they are lo's in the whole band
                shift = tl.maximum(32 - RADIX_BITS * (p + 1), 0)
                lo_s = lo ^ _SIGN
                hi_s = hi ^ _SIGN
                hist = tl.zeros([RADIX], dtype=tl.int32)  # the band's keys by their next digit
                hist = _band_hist(s_row, 0, n_big_r, lo_s, hi_s, shift, hist, RADIX, TILE_R)
                hist = _band_hist(s_row, n_big_r, nv, lo_s, hi_s, shift, hist, RADIX, TILE_SMALL)
                # band keys with a digit >= d; the band's new digit: the highest that still reaches k
                above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
                d = tl.max(tl.where(cnt_hi + above >= k, digits, 0), axis=0)
                n_at = tl.sum(tl.where(digits == d, hist, 0), axis=0)
                cnt_lo = cnt_hi + tl.sum(tl.where(digits == d, above, 0), axis=0)
                cnt_hi = cnt_lo - n_at
                lo = lo | (d << shift)
                hi = lo | ((1 << shift) - 1)

    # Keys above the band are all chosen; of the band's keys the lowest blocks, up to n_pick in all.
    need = n_pick - cnt_hi
    lo_s = lo ^ _SIGN
    hi_s = hi ^ _SIGN
    n_gt = tl.zeros([], dtype=tl.int32)
    n_band = tl.zeros([], dtype=tl.int32)
    n_gt, n_band = _write_chosen(s_row, o_row, 0, n_big_s, lo_s, hi_s, need, n_gt, n_band, C, BLOCK_C, TILE_S)
    _write_chosen(s_row, o_row, n_big_s, nv, lo_s, hi_s, need, n_gt, n_band, C, BLOCK_C, TILE_SMALL)

    # the open tail n_blocks*c .. positions (at most c tokens) after the chosen ones, then -1
    n_sel = n_pick.to(tl.int64) * C
    n_tail = tl.minimum(tl.maximum(pos + 1 - nb * C, 0), C)
    idx0 = tl.arange(0, TILE_L)
    for start in range((n_sel // TILE_L) * TILE_L, L, TILE_L):
        idx = start + idx0
        val = tl.where(idx < n_sel + n_tail, nb * C + idx - n_sel, -1)
        tl.store(o_row + idx, val.to(tl.int32), mask=(idx >= n_sel) & (idx < L))


@dataclass(frozen=True)
class SelectTiles:
    """A launch configuration of `_select_kernel`: it changes the speed only, never the result. tile_r: the
    histogram passes' tile; tile_s / tile_small: the write pass's large and small tiles (tile_small also
    the passes' small one); 2**radix_bits bins a pass."""

    radix_bits: int = 5
    tile_r: int = 8192
    tile_s: int = 4096
    tile_small: int = 1024
    num_warps: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.radix_bits <= 16:
            raise ValueError(f"radix_bits {self.radix_bits} outside 1..16")
        for name in ("tile_r", "tile_s", "tile_small", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} {v} is not a power of two")
        if max(self.tile_s, self.tile_small) >= 2**15:
            raise ValueError("the write pass's tiles must stay below 2**15 (its packed counts are 16 bits)")


# NOTE: the configuration may follow the row count B, since the result is exact whatever it is. A decode
# batch's few rows run one wide program each: 16 warps, the defaults (the fastest measured on an H200 at
# 300 to 65536 valid blocks; 32 bins is one per lane of a warp). A prefill chunk's thousands of rows fill
# every SM many times over, where 8 warps and narrower write tiles took a 4,096-row chunk at positions
# 57,344.. from 1,282 to 872 us and one at 12,288.. from 437 to 248 us on an H100, with the same tokens
# (benchmarks/bench_kernels.py qsa_select; BENCHMARKS.md, Long prefill). PREFILL_ROWS, from the two
# configurations timed side by side at 32 to 4,096 rows (H100): the defaults lead up to 128 rows (49 against
# 55 us at 32 rows near 61K), 8 warps from 256 on (88 against 95 us at 256, 141 against 179 at 512).
DECODE_TILES = SelectTiles()
PREFILL_TILES = SelectTiles(tile_s=1024, tile_small=512, num_warps=8)
PREFILL_ROWS = 256  # B from which PREFILL_TILES run (read at every call)


def select_tiles(rows: int) -> SelectTiles:
    """The configuration `triton_select_decode_tokens` runs for `rows` rows."""
    return PREFILL_TILES if rows >= PREFILL_ROWS else DECODE_TILES


def triton_select_decode_tokens(
    scores: torch.Tensor,
    n_blocks: torch.Tensor,
    positions: torch.Tensor,
    c: int,
    block_topk: int,
    tiles: SelectTiles | None = None,
) -> torch.Tensor:
    """scores [B, M] (float; -inf from column n_blocks[b] on), n_blocks [B], positions [B] ->
    [B, block_topk * c + c] int32, equal to `select_decode_tokens`'s reference for every input.
    Grid (B,); `tiles` (default: `select_tiles(B)`) changes the speed only, never the result."""
    B, M = scores.shape
    L = block_topk * c + c
    out = torch.empty((B, L), dtype=torch.int32, device=scores.device)
    if B == 0:
        return out
    t = tiles or select_tiles(B)
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    _select_kernel[(B,)](
        scores, n_blocks.contiguous(), positions.contiguous(), out, M, min(block_topk, M), L,
        scores.stride(0), out.stride(0),
        C=c, BLOCK_C=triton.next_power_of_2(c), RADIX_BITS=t.radix_bits,
        TILE_R=t.tile_r, TILE_S=t.tile_s, TILE_SMALL=t.tile_small, TILE_L=1024,
        num_warps=t.num_warps, **pdl_args(scores),
    )  # fmt: skip
    return out
