"""The indexer's open block of each decode row, for CUDA: the raw key put in at its place, the slot's tail
rows updated, and the block's mean key, in one launch. Reference: `indexer_open_block` in
nextserve/ops/attention.py (CPU path), whose ~9 torch launches this replaces.

# NOTE: one program per row, over the head dim. The mean adds the c rows in float32 in order,
# ((x0 + x1) + x2) + ..., and scales by the float32 1 / c, as torch's mean over the block dim adds and
# scales (checked bit for bit against it on the GPU), then rounds to the dtype. A program reads its own
# row's slot only (padding rows share the scratch slot, whose contents no real row reads), so a row's
# bits never depend on the rows beside it (C1); no host reads, so a step with it is graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start


@triton.jit
def _open_block(
    raw_ptr, tail_ptr, slot_ptr, pos_ptr, pooled_ptr, start_ptr, stride_raw, DI, inv_c,
    C: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b)
    r = pos % C  # the row's place in its block
    d = tl.arange(0, BLOCK)
    dm = d < DI
    raw = tl.load(raw_ptr + b * stride_raw + d, mask=dm, other=0.0)
    tail = tail_ptr + slot * (C - 1) * DI
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(C):
        if j < C - 1:
            v = tl.where(r == j, raw, tl.load(tail + j * DI + d, mask=dm, other=0.0))
        else:
            v = raw
        acc += v.to(tl.float32)
    tl.store(pooled_ptr + b * DI + d, (acc * inv_c).to(pooled_ptr.dtype.element_ty), mask=dm)
    tl.debug_barrier()  # NOTE: every thread's loads of the tail are done before row r is overwritten
    tl.store(tail + r * DI + d, raw, mask=d < tl.where(r < C - 1, DI, 0))  # row r, if in the tail
    tl.store(start_ptr + b, pos - r)


def triton_indexer_open_block(
    raw: torch.Tensor, tail_plane: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, c: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """See nextserve.ops.attention.indexer_open_block."""
    B, di = raw.shape
    assert raw.stride(-1) == 1 and tail_plane.is_contiguous() and tail_plane.shape[1:] == (c - 1, di)
    assert raw.dtype == tail_plane.dtype, (raw.dtype, tail_plane.dtype)
    pooled = torch.empty((B, di), dtype=raw.dtype, device=raw.device)
    starts = torch.empty((B,), dtype=positions.dtype, device=raw.device)
    if B:
        _open_block[(B,)](
            raw, tail_plane, slots, positions, pooled, starts, raw.stride(0), di, 1.0 / c,
            C=c, BLOCK=triton.next_power_of_2(di), num_warps=1, **pdl_args(raw),
        )  # fmt: skip
    return pooled, starts
