"""Rotary embedding (NeoX rotate-half on the first `rot` dims) for CUDA: one launch per call instead of
the reference's six (slice, neg, cat, two products, sum, cat). Reference: `apply_rope` in
nextserve/ops/rope.py (the CPU path).

# NOTE: one program per (row, head) over the head's D dims: it loads both halves of the rotated part and
# the row's cos/sin, computes x1 c - x2 s and x2 c + x1 s with the reference's roundings (each product
# rounded to the dtype, then the sum), and copies the pass-through dims. Constant block sizes, the row
# count only sizes the grid: a row's bits never depend on the rows beside it (C1). No host reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start


@triton.jit
def _rope(
    x_ptr, cos_ptr, sin_ptr, o_ptr, stride_xt, stride_xh, stride_ct, stride_st, HEADS, D,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    ty = o_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    x_row = x_ptr + t * stride_xt + h * stride_xh
    o_row = o_ptr + (t * HEADS + h) * D
    i = tl.arange(0, BLOCK_H)
    m = i < HALF
    x1 = tl.load(x_row + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + i, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_ct + i, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + i, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + i, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + i, mask=m, other=0.0).to(tl.float32)
    # x_rot * c + rotate_half(x_rot) * s, rotate_half = [-x2, x1]; each product rounded, then the sum
    lo = (x1 * c1).to(ty).to(tl.float32) + (-x2 * s1).to(ty).to(tl.float32)
    hi = (x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)
    tl.store(o_row + i, lo.to(ty), mask=m)
    tl.store(o_row + HALF + i, hi.to(ty), mask=m)
    for d0 in range(2 * HALF, D, BLOCK_D):  # the dims past `rot` pass through
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        tl.store(o_row + d, tl.load(x_row + d, mask=dm, other=0.0), mask=dm)


def triton_apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (unit stride on D); cos, sin [T, rot] (rot even, <= D) -> [T, heads, D]."""
    T, heads, D = x.shape
    rot = cos.shape[-1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out = torch.empty((T, heads, D), dtype=x.dtype, device=x.device)
    if T and heads:
        half = rot // 2
        _rope[(T, heads)](
            x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), heads, D,
            HALF=half, BLOCK_H=triton.next_power_of_2(max(half, 1)), BLOCK_D=128, num_warps=1, **pdl_args(x),
        )  # fmt: skip
    return out
