"""FP8 weights dequantized in one pass (1 byte read and 2 written per value) for prefill chunks' projections
where they do not run as W8A8 (ops/triton/fp8_gemm.py: float32 activations, cards without FP8 MMAs, or
PREFILL_W8A8 off): a prefill chunk is compute-bound, and cuBLAS's bf16 tensor-core GEMM after this pass
beats a Triton GEMM that dequantizes each weight tile in registers (H200, 128 to 8,192 rows, the Flash-Next
projection shapes: the fused kernel of 5ad14e5 ran at 0.45-0.9x this path's speed from 512 rows on, and
won, by up to 1.4x, only at 128-256 rows of the wide in-projections, tens of microseconds a call; H200).
Decode rows keep the small-M GEMV, which reads FP8 in registers (ops/triton/gemv.py): there the bytes are
the cost.

# NOTE: the values are ops/fp8.py `dequantize`'s bits (q * s in float32, rounded once), so a chunk's
# projection is F.linear on exactly the dequantized weight, as on the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8 import BLOCK, Fp8Weight


@triton.jit
def _dequantize(q_ptr, s_ptr, out_ptr, N, K, stride_qn, stride_sn, stride_on, BLOCK: tl.constexpr):
    """out[n, k] = q[n, k] * s[n // 128, k // 128] in float32, rounded once; program = one 128 x 128 block."""
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rk = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    s = tl.load(s_ptr + tl.program_id(0) * stride_sn + tl.program_id(1))
    w = tl.load(q_ptr + rn[:, None].to(tl.int64) * stride_qn + rk[None, :], mask=mask, other=0.0)
    out = (w.to(tl.float32) * s).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rn[:, None].to(tl.int64) * stride_on + rk[None, :], out, mask=mask)


def triton_dequantize(weight: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """`ops.fp8.dequantize` of a 2-D weight in one pass (1 byte read, 2 written per value), same bits."""
    q, scale = weight.q, weight.scale.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    N, K = q.shape
    out = torch.empty((N, K), dtype=dtype, device=q.device)
    grid = (triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK))
    _dequantize[grid](
        q, scale, out, N, K, q.stride(0), scale.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=8
    )  # fmt: skip
    return out
