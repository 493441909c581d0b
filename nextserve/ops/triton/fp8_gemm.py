"""Prefill chunks' FP8 projections on FP8 tensor cores (W8A8), as block-FP8 releases are meant to run: the
chunk's activations quantized per token and 128 columns (`_quantize_rows`), then one GEMM of E4M3 codes
whose float32 partials are scaled per 128-wide K block by the activation and weight scales
(`_w8a8_gemm`), the scheme of DeepSeek's and Qwen's FP8 releases (vLLM's and SGLang's block-FP8 path).
References: ops/fp8.py `quantize_activations` (the same bits) and `w8a8_linear` (close: the MMA adds a
block's 128 products in its own order).

Decode-sized work keeps the row-invariant GEMV, which reads FP8 weights against 16-bit activations
(ops/triton/gemv.py). This GEMM is row-invariant too (every tile size is fixed, a row's codes and scales
are its own), but it is used for prefill chunks only: it quantizes the activations, which decode rows keep
16-bit (docs: DESIGN, weights that do not fit).

# NOTE: FP8 MMAs need sm_89 or newer (Ada, Hopper); older cards and float32 activations keep the
# dequantize-then-GEMM path (ops/triton/fp8_dequant.py), as does everything while `PREFILL_W8A8` (and
# moe_grouped's PREFILL_EXPERTS_W8A8) is off: the default, from the measurements in the NOTE below.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..fp8 import BLOCK, FP8_MAX, Fp8Weight

# NOTE: off by default. With it on, and the grouped prefill experts as W8A8 too (moe_grouped
# PREFILL_EXPERTS_W8A8), a cold 62,700-token FP8 prompt took 0.857 s against 0.626 s with both off, 8,192
# tokens 66,045 against 96,806 tok/s (H100, random 8-layer FP8 weights; BENCHMARKS.md, Long prefill),
# though the projections alone through cuBLAS's block-scaled GEMM ran 1.45-1.7x faster than the
# dequantize-then-GEMM path at 4,096-8,192 rows (same call). The projections alone have not been measured
# end to end.
PREFILL_W8A8 = False  # prefill chunks' FP8 projections as W8A8 where the card has FP8 MMAs
# NOTE: the projections' GEMM: "cublas": torch's block-scaled scaled_mm (cuBLASLt 1x128 x 128x128 scaling,
# sm_90 with cuBLAS 12.9 or newer: 0.814 against 0.857 s for the 62,700-token prompt above, 1.6-1.7x the
# Triton GEMM's speed on the projections), else "triton" (`_w8a8_gemm`, also where cuBLAS lacks it)
W8A8_GEMM = "cublas"
QUANT_ROWS = 16  # rows of a quantization program
BLOCK_M, BLOCK_N, GROUP_M = 128, 128, 8  # GEMM tiles (K tiles are the 128-wide scale blocks)


@functools.cache
def _fp8_mma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_mma_rows(x: torch.Tensor) -> bool:
    """Whether rows x may run as W8A8 (the module docstring's NOTE): 16-bit, on a card with FP8 MMAs (or in
    Triton's interpreter, on the CPU)."""
    return x.dtype in (torch.bfloat16, torch.float16) and (not x.is_cuda or _fp8_mma(x.device))


def w8a8_applies(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """Whether a prefill chunk's projection x @ weight^T runs here (PREFILL_W8A8)."""
    return PREFILL_W8A8 and fp8_mma_rows(x) and x.dim() == 2 and weight.q.dim() == 2


@triton.jit
def _round_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest E4M3 value, ties to even, still float32.
    # NOTE: the rounding is done here, by adding and taking away a power of two that leaves the value's
    # E4M3 step as float32's step, so the conversion after it is exact: the interpreter's own float32 to
    # E4M3 conversion rounds some values near a power of two down a binade."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    step = tl.maximum((mag >> 23) - 3, 127 - 9)  # E4M3's step at |v|: 2^(e-3), subnormals 2^-9
    big = ((step + 23) << 23).to(tl.float32, bitcast=True) * 1.5  # 1.5 * 2^23 steps
    r = (mag.to(tl.float32, bitcast=True) + big) - big  # |v| rounded
    return (r.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)  # v's sign


@triton.jit
def _quantize_rows(x_ptr, q_ptr, s_ptr, T, K, stride_x, stride_q, stride_s, stride_sg, ROWS: tl.constexpr,
                   BLOCK: tl.constexpr, FP8_MAX: tl.constexpr):  # fmt: skip
    """Program (row tile, group): q = x / s rounded to E4M3, s = amax / 448 per row of the 128 columns."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < T)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [ROWS]
    s = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32)), 1.0)
    v = tl.clamp(tl.math.div_rn(x, s[:, None]), -FP8_MAX, FP8_MAX)
    q = _round_e4m3(v).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_q + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows * stride_s + tl.program_id(1) * stride_sg, s, mask=rows < T)


def quantize_activations(
    x: torch.Tensor, scales_by_column: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.fp8.quantize_activations in one pass (the same bits); `scales_by_column`: the scales [T, G] laid
    out column by column (strides (1, T)), as cuBLAS's 1x128 scaling reads them."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, k = x.shape
    groups = triton.cdiv(k, BLOCK)
    q = torch.empty((t, k), dtype=torch.float8_e4m3fn, device=x.device)
    if scales_by_column:
        s = torch.empty((groups, t), dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty((t, groups), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(t, QUANT_ROWS), groups)
    _quantize_rows[grid](
        x, q, s, t, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1), ROWS=QUANT_ROWS, BLOCK=BLOCK,
        FP8_MAX=FP8_MAX, num_warps=4,
    )  # fmt: skip
    return q, s


@functools.cache
def _cublas_block_fp8(device: torch.device) -> bool:
    """Whether torch's scaled_mm takes 1x128 x 128x128 scales on this device (sm_90, cuBLAS >= 12.9)."""
    if torch.cuda.get_device_capability(device) != (9, 0) or not hasattr(torch.nn.functional, "scaled_mm"):
        return False
    x = torch.ones((128, 256), dtype=torch.bfloat16, device=device)
    w = Fp8Weight(
        torch.ones((128, 256), device=device).to(torch.float8_e4m3fn), torch.ones((1, 2), device=device)
    )
    try:
        return bool((cublas_w8a8_linear(x, w) == 256).all())
    except (RuntimeError, NotImplementedError):
        return False


def cublas_w8a8_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x @ weight^T through torch's block-scaled scaled_mm: the weight's scales transposed, their K blocks
    padded to a multiple of 4 (cuBLAS's layout)."""
    F = torch.nn.functional
    xq, xs = quantize_activations(x, scales_by_column=True)
    nb, kb = weight.scale.shape
    ws = torch.zeros((nb, -(-kb // 4) * 4), dtype=torch.float32, device=x.device)
    ws[:, :kb] = weight.scale
    return F.scaled_mm(
        xq, weight.q.t(), xs, F.ScalingType.BlockWise1x128, ws.t(), F.ScalingType.BlockWise128x128,
        output_dtype=x.dtype,
    )  # fmt: skip


@triton.jit
def _w8a8_gemm(xq_ptr, xs_ptr, wq_ptr, ws_ptr, y_ptr, M, N, K, stride_xm, stride_xs, stride_wn, stride_ws,
               stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_M: tl.constexpr):  # fmt: skip
    """y [M, N] = sum over K blocks of (codes dot) * x scale * w scale; program = one output tile, tiles in
    groups of GROUP_M row tiles (a group's weight tiles stay in L2)."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    x_rows = xq_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_cols = wq_ptr + rn[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + rk
        k_ok = k < K
        a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        b = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]
        sa = tl.load(xs_ptr + rm * stride_xs + kb, mask=m_ok, other=0.0)  # [BM]
        sb = tl.load(ws_ptr + (rn // BLOCK_K) * stride_ws + kb, mask=n_ok, other=0.0)  # [BN]
        acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    y_mask = m_ok[:, None] & n_ok[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], y, mask=y_mask)


def w8a8_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x [T, K] @ weight^T -> [T, N] in x's dtype (ops.fp8.w8a8_linear's scheme), through `W8A8_GEMM`."""
    if W8A8_GEMM == "cublas" and x.is_cuda and _cublas_block_fp8(x.device):
        return cublas_w8a8_linear(x, weight)
    xq, xs = quantize_activations(x)
    wq, ws = weight.q, weight.scale
    wq = wq if wq.stride(-1) == 1 else wq.contiguous()
    ws = ws if ws.stride(-1) == 1 else ws.contiguous()
    (m, k), n = xq.shape, wq.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
    _w8a8_gemm[grid](
        xq, xs, wq, ws, y, m, n, k, xq.stride(0), xs.stride(0), wq.stride(0), ws.stride(0), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK, GROUP_M=GROUP_M, num_warps=8, num_stages=4,
    )  # fmt: skip
    return y
