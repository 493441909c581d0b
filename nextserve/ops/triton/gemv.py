"""Row-invariant small-M GEMM (decode, batched decode, verify windows) for CUDA.

# NOTE: every row is computed by the same instruction sequence whatever M is: rows are padded to a
# fixed block of 16, the K loop runs in fixed BLOCK_K tiles in order, and one compiled kernel serves
# every M (M is not a compile-time constant). A tensor-core MMA gives an output element from its own
# row of A and column of B, so a row's bits never depend on the rows beside it (C1) - by construction,
# where cuBLAS may pick its algorithm (and split-K) from M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


@triton.jit
def _small_m_gemm(
    x_ptr, w_ptr, y_ptr, M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :],
            mask=(rm[:, None] < M) & (rk[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + rn[None, :] * stride_wn + rk[:, None],
            mask=(rn[None, :] < N) & (rk[:, None] < K),
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


def small_m_linear(
    x: torch.Tensor, weight: torch.Tensor, block_n: int = 32, block_k: int = 128
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] (CUDA, any M), row-invariant; accumulates in float32.
    The tile sizes are part of the numerics: a row's bits are fixed for a given (block_n, block_k)."""
    x = x.contiguous()
    weight = weight.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, BLOCK_M))
    _small_m_gemm[grid](
        x, weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return y
