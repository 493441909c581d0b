"""Prefill projections with block-wise FP8 weights (ops/fp8.py): x [M, K] (16-bit) @ dequant(q)[N, K]^T
in one kernel, each weight tile read as FP8 (half the bytes of bf16) and dequantized in registers the way
`dequantize` rounds (q * s in float32, rounded once to x's dtype), then a tensor-core dot accumulated in
float32 over K in ascending tiles. It replaces dequantizing the whole weight for every prefill chunk (a
bf16 copy of every projection written and read again per chunk) followed by cuBLAS.

# NOTE: numerics. The tiling is a function of (N, K, dtype) alone (`_config`), never of M, and the grid is
# a plain map over output tiles (no split-K, no atomics): a call's bits are a function of its inputs.
# Prefill chunks do not need the decode path's row invariance (the serial reference runs the same chunks
# through this same call), but a row's bits here do not depend on M either: only the number of row tiles
# changes with it. The decode rows (M <= 40) keep the small-M GEMV (gemv.py).
# NOTE: the dequantized tile is the dot's first operand (W_AS_A: out^T = w . x^T): on sm_90 the
# warpgroup MMA takes its A operand from registers, so the tile goes from the convert straight into the
# MMA; as B it would make a round trip through shared memory. benchmarks/bench_fp8_prefill.py measures
# both against dequantize + cuBLAS and the bf16 GEMM.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..fp8 import BLOCK, Fp8Weight

FUSED_MAX_ROWS = 512  # measured crossover, bench_fp8_prefill.py on the H200 (BENCHMARKS.md)


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int  # row tiles walked together over the column tiles (L2 reuse of weight tiles)
    num_warps: int
    num_stages: int
    w_as_a: bool


@functools.cache
def _config(N: int, K: int, dtype: torch.dtype) -> Config:
    """The launch configuration for an [N, K] FP8 weight: of (N, K, dtype) only (it sets the numerics)."""
    if dtype == torch.float32:
        return Config(64, 64, 32, 8, 4, 3, False)
    # the best of bench_fp8_prefill.py --sweep at M = 1024 on the H200 for the in-projections (BENCHMARKS.md)
    return Config(256, 128, 64, 8, 8, 3, True)


@triton.jit(do_not_specialize=["M"])
def _fp8_linear(
    x_ptr, q_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, W_AS_A: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """out[m, n] = sum_k x[m, k] * (q[n, k] * s[n // 128, k // 128]); program = one output tile."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    ty = x_ptr.dtype.element_ty
    s_rows = s_ptr + (rn // 128) * stride_sn  # [BN]: each output column's row of scales
    if W_AS_A:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        x_ptrs = x_ptr + rm[None, :].to(tl.int64) * stride_xm + rk[:, None]  # [BK, BM]
        w_ptrs = q_ptr + rn[:, None].to(tl.int64) * stride_qn + rk[None, :]  # [BN, BK]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]  # [BM, BK]
        w_ptrs = q_ptr + rn[None, :].to(tl.int64) * stride_qn + rk[:, None]  # [BK, BN]
    for k0 in range(0, K, BLOCK_K):
        s = tl.load(s_rows + k0 // 128, mask=mask_n, other=0.0)  # [BN]
        if W_AS_A:
            if EVEN_K:
                w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
                xt = tl.load(x_ptrs, mask=mask_m[None, :], other=0.0)
            else:
                mask_k = (k0 + rk) < K
                w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
                xt = tl.load(x_ptrs, mask=mask_k[:, None] & mask_m[None, :], other=0.0)
            w = (w.to(tl.float32) * s[:, None]).to(ty)
            acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        else:
            if EVEN_K:
                a = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                mask_k = (k0 + rk) < K
                a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            w = (w.to(tl.float32) * s[None, :]).to(ty)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dt = out_ptr.dtype.element_ty
    if W_AS_A:
        o_ptrs = out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
        tl.store(o_ptrs, acc.to(dt), mask=mask_n[:, None] & mask_m[None, :])
    else:
        o_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(o_ptrs, acc.to(dt), mask=mask_m[:, None] & mask_n[None, :])


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


def fp8_prefill_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """A prefill chunk's projection on an FP8 weight: the fused kernel up to FUSED_MAX_ROWS rows, where
    reading FP8 saves time; above, where the GEMM is compute-bound and cuBLAS's bf16 tensor-core rate
    beats the fused kernel's by more than one pass over the weight costs, the weight dequantized in one
    pass (`triton_dequantize`) and then cuBLAS. The choice is a function of the chunk's row count, which
    the chunk grid fixes (C1)."""
    if x.shape[0] <= FUSED_MAX_ROWS:
        return fp8_linear(x, weight)
    return torch.nn.functional.linear(x, triton_dequantize(weight, x.dtype))


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, config: Config | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] in x.dtype, the FP8 weight read as it is stored. `config`
    overrides the shape's configuration (the benchmark that compares them)."""
    q, scale = weight.q, weight.scale
    assert q.dim() == 2 and x.dim() == 2 and x.shape[1] == q.shape[1], (x.shape, q.shape)
    M, K = x.shape
    N = q.shape[0]
    cfg = config or _config(N, K, x.dtype)
    # NOTE: a K tile never straddles two scale blocks (its scale is one value per column)
    assert BLOCK % cfg.block_k == 0, cfg
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    scale = scale.contiguous()
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _fp8_linear[grid](
        x, q, scale, out, M, N, K, x.stride(0), q.stride(0), scale.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=K % cfg.block_k == 0, W_AS_A=cfg.w_as_a,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
