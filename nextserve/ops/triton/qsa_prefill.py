"""QSA prefill for CUDA: the indexer block scores of a whole prefill chunk on tensor cores.
Reference: `prefill_index_scores` in nextserve/ops/attention.py (the per-row rule, CPU path).

A chunk's rows are consecutive positions start .. start+T-1 of one sequence, so they share one block
table and every row's complete blocks are a prefix of the last row's. The decode kernel scores one row
at a time on CUDA cores, reading every block key once per row (a 62.7K prompt: 175 ms); here a program
scores a tile of rows against a tile of block keys with one MMA per indexer head, each key tile read
once per row tile.

# NOTE: prefill chunks are not decode-sized work: C1 asks only that a chunk's result depend on the
# chunk alone (a resumed prefill runs the very chunks a cold one runs). An element is one dot product
# over di of its row's query and its block's key, by the MMA's fixed K order, whatever the rows beside
# it; tiles and warps are constants. The bits differ from the decode kernel's (float32 FMA order), which
# only decode rows use. The scores' width is the chunk's last row's block count rounded up to whole
# tiles, so the integers a kernel specialises on keep one value class (no compile after the warm-up).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import unit_stride
from .kv8 import dequantize_rows, kv8_args

BLOCK_T = 64  # rows of a tile
BLOCK_J = 64  # blocks of a tile; the scores' width is a multiple of it


# NOTE: the row strides are specialised (q's is the model's, out's the width: a multiple of BLOCK_J, one
# value class), so rows are known 16-byte aligned and loads and stores move 16 bytes at a time.
@triton.jit(do_not_specialize=["T", "n_cols", "start"])
def _prefill_index_scores_kernel(
    q_ptr, key_ptr, ks_ptr, bt_ptr, out_ptr, T, n_cols, start, bpp, inv_scale,
    stride_qt, stride_qh, stride_kp, stride_ki, stride_ksp, stride_ot,
    NI: tl.constexpr, DI: tl.constexpr, BLOCK_DI: tl.constexpr, C: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr, IEEE: tl.constexpr, KV8: tl.constexpr = False,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    tm = t < T
    n_blocks = (start + t + 1) // C  # [BLOCK_T] complete blocks of each row
    last = tl.minimum(tl.program_id(0) * BLOCK_T + BLOCK_T, T) - 1
    tile_blocks = (start + last + 1) // C  # the tile's last row sees the most
    score = tl.full((BLOCK_T, BLOCK_J), float("-inf"), dtype=tl.float32)
    if tl.program_id(1) * BLOCK_J < tile_blocks:
        jm = j < tile_blocks
        page = tl.load(bt_ptr + j // bpp, mask=jm, other=0).to(tl.int64)
        d = tl.arange(0, BLOCK_DI)
        dm = d < DI
        keys = tl.load(
            key_ptr + page[:, None] * stride_kp + (j % bpp)[:, None] * stride_ki + d[None, :],
            mask=jm[:, None] & dm[None, :],
            other=0.0,
        )
        if KV8:
            ks = tl.load(ks_ptr + page * stride_ksp + j % bpp, mask=jm, other=0.0)
            keys = dequantize_rows(keys, ks, q_ptr.dtype.element_ty)
        keys = keys.to(q_ptr.dtype.element_ty)  # [BLOCK_J, BLOCK_DI]
        acc = tl.zeros((BLOCK_T, BLOCK_J), dtype=tl.float32)
        for h in tl.static_range(NI):
            qh = tl.load(
                q_ptr + t[:, None].to(tl.int64) * stride_qt + h * stride_qh + d[None, :],
                mask=tm[:, None] & dm[None, :],
                other=0.0,
            )  # [BLOCK_T, BLOCK_DI]
            if IEEE:
                s = tl.dot(qh, tl.trans(keys), input_precision="ieee")
            else:
                s = tl.dot(qh, tl.trans(keys))
            acc += tl.maximum(s, 0.0)
        score = tl.where(j[None, :] < n_blocks[:, None], acc * inv_scale, score)
    out = out_ptr + t[:, None].to(tl.int64) * stride_ot + j[None, :]
    tl.store(out, score, mask=tm[:, None] & (j < n_cols)[None, :])


def prefill_score_width(start: int, T: int, c: int) -> int:
    """The scores' width of a chunk: its last row's complete blocks, in whole BLOCK_J tiles."""
    return max(1, triton.cdiv((start + T) // c, BLOCK_J)) * BLOCK_J


def triton_prefill_index_scores(
    q_idx: torch.Tensor, key_plane: torch.Tensor, table_row: torch.Tensor, start: int, c: int
) -> torch.Tensor:
    """q_idx [T, Ni, di] of positions start .. start+T-1; key_plane [pages, bpp, di] (or an Kv8Plane of
    it); table_row [maxP]
    -> [T, prefill_score_width] float32: sum_h relu(q_h . k_j) / sqrt(di) for the row's complete blocks
    j < (position + 1) // c, -inf after. Grid (T / BLOCK_T, width / BLOCK_J)."""
    T, NI, DI = q_idx.shape
    key_plane, key_scale, kv8 = kv8_args(key_plane)
    q_idx = unit_stride(q_idx)
    width = prefill_score_width(start, T, c)
    out = torch.empty((T, width), dtype=torch.float32, device=q_idx.device)
    if T == 0:
        return out
    grid = (triton.cdiv(T, BLOCK_T), width // BLOCK_J)
    _prefill_index_scores_kernel[grid](
        q_idx, key_plane, key_scale, table_row.contiguous(), out, T, width, start, key_plane.shape[1],
        1.0 / math.sqrt(DI), q_idx.stride(0), q_idx.stride(1), key_plane.stride(0), key_plane.stride(1),
        key_scale.stride(0), out.stride(0),
        NI=NI, DI=DI, BLOCK_DI=max(16, triton.next_power_of_2(DI)), C=c, BLOCK_T=BLOCK_T, BLOCK_J=BLOCK_J,
        IEEE=q_idx.dtype == torch.float32, KV8=kv8, num_warps=4,
    )  # fmt: skip
    return out
