"""One row per decode row written into paged planes (the K and V pages, the indexer's block keys), for
CUDA: the address (page from the row's block table, offset in it) and the copies in one launch; 8-bit
planes (ops/kv8.py Kv8Plane) quantize each vector in the same launch, a launch a plane.
Reference: `write_paged_rows` in nextserve/ops/paged.py (its int8 planes: ops/kv8.py quantize_rows).

# NOTE: program (row, column block) copies its row's values only, to its own address: a row's writes
# never depend on the rows beside it (C1); no host reads, so a step with it is graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv8 import QMAXES, Kv8Plane
from .common import pdl_args, pdl_start, unit_stride
from .fp8_gemm import _round_e4m3

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


@triton.jit
def _write_rows_kv8(
    table_ptr, pos_ptr, q_ptr, s_ptr, v_ptr, stride_table, stride_v, VECS, D, UNIT, PER_PAGE,
    QMAX: tl.constexpr, FP8: tl.constexpr, VP: tl.constexpr, DP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program = one row: its VECS vectors of D values quantized (scale = max|x| / QMAX, q = x / scale
    rounded half to even: to an integer, or with FP8 to an E4M3 value) and stored at the row's address,
    codes and scales."""
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    vec, col = tl.arange(0, VP), tl.arange(0, DP)
    mask = (vec < VECS)[:, None] & (col < D)[None, :]
    entry = tl.load(pos_ptr + r) // UNIT
    page = tl.load(table_ptr + r * stride_table + entry // PER_PAGE).to(tl.int64)
    slot = page * PER_PAGE + entry % PER_PAGE
    x = tl.load(v_ptr + r * stride_v + vec[:, None] * D + col[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [VP]
    scale = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
    divisor = tl.where(scale > 0, scale, 1.0)
    v = tl.clamp(tl.math.div_rn(x, divisor[:, None]), -QMAX, QMAX)
    if FP8:
        v = _round_e4m3(v)
    else:
        v = (v + 12582912.0) - 12582912.0  # (1.5 * 2^23: |v| <= 127 rounded to an integer, half to even)
    q = v.to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + slot * VECS * D + vec[:, None] * D + col[None, :], q, mask=mask)
    tl.store(s_ptr + slot * VECS + vec, scale, mask=vec < VECS)


def kv8_writable(planes: tuple[Kv8Plane, ...]) -> bool:
    """Whether `triton_write_paged_kv8` takes these 8-bit planes: contiguous codes and scales."""
    return all(p.values.is_contiguous() and p.scale.is_contiguous() for p in planes)


def triton_write_paged_kv8(
    planes: tuple[Kv8Plane, ...],
    values: tuple[torch.Tensor, ...],
    block_table: torch.Tensor,
    positions: torch.Tensor,
    per_page: int,
    unit: int = 1,
) -> None:
    """ops/paged.write_paged_rows for 8-bit planes (Kv8Plane, int8 or fp8): each entry's vectors (its last
    dimension) quantized as ops/kv8.quantize_rows does, bit for bit."""
    B = positions.shape[0]
    if B == 0:
        return
    for plane, value in zip(planes, values, strict=True):
        D = plane.values.shape[-1]
        vecs = plane.values[0, 0].numel() // D
        v = unit_stride(value.reshape(B, vecs * D))
        _write_rows_kv8[(B,)](
            block_table, positions, plane.values, plane.scale, v, block_table.stride(0), v.stride(0), vecs, D,
            unit, per_page, QMAX=QMAXES[plane.form], FP8=plane.form == "fp8", VP=triton.next_power_of_2(vecs),
            DP=triton.next_power_of_2(D),
            **pdl_args(v),
        )  # fmt: skip
