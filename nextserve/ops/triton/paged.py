"""One row per decode row written into paged planes (the K and V pages, the indexer's block keys), for
CUDA: the address (page from the row's block table, offset in it) and the copies in one launch.
Reference: `write_paged_rows` in nextserve/ops/paged.py.

# NOTE: program (row, column block) copies its row's values only, to its own address: a row's writes
# never depend on the rows beside it (C1); no host reads, so a step with it is graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start, unit_stride

MAX_BLOCK = 1024


@triton.jit
def _write_rows(
    table_ptr, pos_ptr, a_ptr, va_ptr, b_ptr, vb_ptr, stride_table, stride_va, stride_vb, ROW, UNIT, PER_PAGE,
    TWO: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ROW
    entry = tl.load(pos_ptr + r) // UNIT
    page = tl.load(table_ptr + r * stride_table + entry // PER_PAGE).to(tl.int64)
    dst = (page * PER_PAGE + entry % PER_PAGE) * ROW + cols
    tl.store(a_ptr + dst, tl.load(va_ptr + r * stride_va + cols, mask=mask), mask=mask)
    if TWO:
        tl.store(b_ptr + dst, tl.load(vb_ptr + r * stride_vb + cols, mask=mask), mask=mask)


def triton_write_paged_rows(
    planes: tuple[torch.Tensor, ...],
    values: tuple[torch.Tensor, ...],
    block_table: torch.Tensor,
    positions: torch.Tensor,
    per_page: int,
    unit: int = 1,
) -> None:
    """ops/paged.write_paged_rows for one or two contiguous planes of one entry shape."""
    B = positions.shape[0]
    row = planes[0][0, 0].numel()
    assert all(p.shape == planes[0].shape and p.dtype == planes[0].dtype for p in planes), "planes differ"
    vals = [unit_stride(v.reshape(B, row)) for v in values]
    if B == 0:
        return
    block = min(MAX_BLOCK, triton.next_power_of_2(row))
    two = len(planes) == 2
    a, b = planes[0], planes[-1]
    va, vb = vals[0], vals[-1]
    _write_rows[(B, triton.cdiv(row, block))](
        block_table, positions, a, va, b, vb, block_table.stride(0), va.stride(0), vb.stride(0), row, unit,
        per_page, TWO=two, BLOCK=block, **pdl_args(a),
    )  # fmt: skip
