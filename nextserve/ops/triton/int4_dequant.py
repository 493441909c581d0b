"""int4 weights dequantized in one pass (half a byte read and 2 written per value) for prefill chunks'
projections, as ops/triton/fp8_dequant.py does for FP8: a chunk is compute-bound, and cuBLAS's 16-bit GEMM
then runs on exactly the dequantized weight. Decode rows keep the small-M GEMV, which reads the words in
registers (ops/triton/gemv.py); the routed experts dequantize their tiles in the grouped kernels
(ops/triton/moe_grouped.py).

# NOTE: the values are ops/int4.py `dequantize`'s bits (int4_tiles.py's NOTE), so a chunk's projection is
# F.linear on the weight the format library computes, as on the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..int4 import Int4Weight
from .int4_tiles import int4_launch_args, int4_tile

BLOCK_N, BLOCK_K = 64, 128


@triton.jit
def _dequantize(
    w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
    GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[n, k] for one [BLOCK_N rows, BLOCK_K columns] block (program (row block, column block))."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rk = tl.arange(0, BLOCK_K)
    rkw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    col_ok = rn < N
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rkw[:, None]
    w_mask = col_ok[None, :] & (rkw * 8 < K)[:, None]
    s_rows = s_ptr + rn.to(tl.int64) * stride_sn
    z_rows = z_ptr + rn.to(tl.int64) * stride_sn
    ty = out_ptr.dtype.element_ty
    w = int4_tile(w_ptrs, w_mask, s_rows, z_rows, k0, rk, K, col_ok, ty, GROUP, BLOCK_K, BLOCK_N, HAS_ZERO)
    kk = k0 + rk
    o_ptrs = out_ptr + rn[None, :].to(tl.int64) * stride_on + kk[:, None]
    tl.store(o_ptrs, w, mask=col_ok[None, :] & (kk < K)[:, None])


def triton_dequantize_int4(weight: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """`ops.int4.dequantize` of an int4 weight [..., N, K] in one pass, the same bits."""
    packed, scale, zero, keys = int4_launch_args(weight)
    *lead, n, width = packed.shape
    rows = packed.reshape(-1, width)
    k = weight.k
    out = torch.empty((*lead, n, k), dtype=dtype, device=packed.device)
    total = rows.shape[0]
    if total == 0 or k == 0:
        return out
    grid = (triton.cdiv(total, BLOCK_N), triton.cdiv(k, BLOCK_K))
    groups = scale.shape[-1]
    _dequantize[grid](
        rows, scale.reshape(-1, groups), zero.reshape(-1, groups), out.view(-1, k), total, k,
        rows.stride(0), groups, k, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4, **keys,
    )  # fmt: skip
    return out
