"""The depthwise causal conv of a prefill chunk for CUDA: all T rows in one launch.
Reference: `nextserve.ops.conv.conv_chunk` on the CPU (`causal_conv`, then SiLU).

The torch reference runs a tap at a time over the whole chunk (K products and K-1 sums of [T, C], each a
pass over memory in the model dtype, the products over a strided weight column): 65-110 ms of a 62.7K
prompt's prefill at 8 layers. Here a program computes a tile of rows and channels, reading each input
once per tap from L2, the taps in float32 in a fixed order (k = 0..K-1) with SiLU fused, as the decode
step (`conv_step.py`) does: equal to the reference to rounding.

The GDN's conv (K = 4, dilation 1) takes another form with the same arithmetic, `_conv_rows`: a program
walks 32 rows of a 512-column strip, loading each input row once and keeping the last three in registers.
At 4,096 rows of the GDN's 10,240 channels it took 78-83 us where the tiles took 155 (H100,
benchmarks/bench_kernels.py prefill_pointwise --sweep; BENCHMARKS.md, Long prefill), with the tiles' bits
(tests/ops/test_conv_chunk.py). Other taps and dilations (the PLE's conv) keep the tiles.

# NOTE: tiles and warps are constants and T only sizes the grid: an element's bits depend on its own
# inputs alone, so a chunk's result is the chunk's (C1). The history is only read here (the caller
# stores the new one), so no program races another.

With `parts` the output's column ranges [0, P1), [P1, P2), [P2, C) are stored one after another, each a
contiguous [T, width] block (the GDN's q, k and v, which fla's chunked kernels read contiguous: they
copied the column slices, 9.4 ms of a 62.7K-token prefill's kernels on the H200). Where an
element is stored changes nothing of its value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import unit_stride

BLOCK_T = 16
BLOCK_C = 256
NUM_WARPS = 4
# the row walk of the GDN's conv (K = 4, dilation 1; `_conv_rows`): rows a program walks (a multiple of 4;
# 0: the tiles instead), its columns and warps
ROWS = 32
ROWS_BLOCK_C = 512
ROWS_WARPS = 4


# NOTE: T is not specialised (one binary for every chunk length); the row strides are, so that a row's
# address is known 16-byte aligned and the tiles load and store 16 bytes at a time (unspecialised, every
# element was its own 2-byte access).
@triton.jit(do_not_specialize=["T"])
def _conv_chunk(
    x_ptr, hist_ptr, w_ptr, out_ptr, T, C, L, P1, P2,
    stride_xt, stride_hc, stride_hl, stride_wc, stride_wk, stride_ot,
    K: tl.constexpr, DIL: tl.constexpr, SILU: tl.constexpr, PARTS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    x_dtype = x_ptr.dtype.element_ty
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tm, cm = t < T, c < C
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    # NOTE: only tiles starting before row L reach back into the history: the others skip its loads (all
    # masked off, but each a strided 2-byte access still issued), the values unchanged
    reads_history = tl.program_id(0) * BLOCK_T < L
    for k in tl.static_range(K):
        w = tl.load(w_ptr + c * stride_wc + k * stride_wk, mask=cm, other=0.0).to(x_dtype).to(tl.float32)
        src = t - (K - 1 - k) * DIL  # [BLOCK_T] the input row of tap k; < 0: the history's column L + src
        in_x = (src >= 0)[:, None] & tm[:, None] & cm[None, :]
        xv = tl.load(x_ptr + src[:, None].to(tl.int64) * stride_xt + c[None, :], mask=in_x, other=0.0)
        val = xv.to(tl.float32)
        if reads_history:
            in_h = (src < 0)[:, None] & tm[:, None] & cm[None, :]
            h_ptrs = hist_ptr + c[None, :] * stride_hc + (L + src)[:, None] * stride_hl
            hv = tl.load(h_ptrs, mask=in_h, other=0.0)
            val = tl.where(in_x, val, hv.to(x_dtype).to(tl.float32))
        if k == 0:
            acc = val * w[None, :]
        else:
            acc = acc + val * w[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    t64 = t[:, None].to(tl.int64)
    if PARTS:  # column c of the part starting at column s (width w) at T * s + t * w + (c - s)
        c0 = tl.program_id(1) * BLOCK_C  # a tile lies in one part (BLOCK_C divides P1 and P2)
        start = tl.where(c0 >= P2, P2, tl.where(c0 >= P1, P1, 0))
        width = tl.where(c0 >= P2, C - P2, tl.where(c0 >= P1, P2 - P1, P1))
        out = out_ptr + T.to(tl.int64) * start + t64 * width + (c - start)[None, :]
    else:
        out = out_ptr + t64 * stride_ot + c[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tm[:, None] & cm[None, :])


@triton.jit
def _row_in(x_ptr, hist_ptr, t, c, cm, L, stride_xt, stride_hc, stride_hl, x_dtype: tl.constexpr):
    """Input row t (t < 0: the history's column L + t) of the columns c, in float32 through x's dtype."""
    if t >= 0:
        v = tl.load(x_ptr + t.to(tl.int64) * stride_xt + c, mask=cm, other=0.0).to(tl.float32)
    else:
        v = tl.load(hist_ptr + c * stride_hc + (L + t) * stride_hl, mask=cm, other=0.0)
        v = v.to(x_dtype).to(tl.float32)
    return v


@triton.jit
def _tap4(a, b, c, d, w0, w1, w2, w3, SILU: tl.constexpr):
    """One output row from its four inputs, oldest first: the taps in `_conv_chunk`'s order."""
    acc = a * w0
    acc = acc + b * w1
    acc = acc + c * w2
    acc = acc + d * w3
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


@triton.jit
def _row_out(out_ptr, t, T, c, C, start, width, stride_ot, y, PARTS: tl.constexpr):
    """Store output row t (masked past T) of the columns c: at T * start + t * width + (c - start) in the
    parts' layout, else at t * stride_ot + c."""
    t64 = t.to(tl.int64)
    if PARTS:
        ptr = out_ptr + T.to(tl.int64) * start + t64 * width + (c - start)
    else:
        ptr = out_ptr + t64 * stride_ot + c
    tl.store(ptr, y.to(out_ptr.dtype.element_ty), mask=c < tl.where(t < T, C, 0))


@triton.jit(do_not_specialize=["T"])
def _conv_rows(
    x_ptr, hist_ptr, w_ptr, out_ptr, T, C, L, P1, P2,
    stride_xt, stride_hc, stride_hl, stride_wc, stride_wk, stride_ot,
    SILU: tl.constexpr, PARTS: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """K = 4, dilation 1: a program walks ROWS rows of a column strip, four at a time, each input row loaded
    once (the three before its first row too) and kept in registers for the outputs that read it.

    # NOTE: every output is `_conv_chunk`'s arithmetic on the same inputs (the taps k = 0..3 in float32 in
    # that order, then SiLU): only which program computes it and where its inputs come from change."""
    x_dtype = x_ptr.dtype.element_ty
    t0 = tl.program_id(0) * ROWS
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    w0 = tl.load(w_ptr + c * stride_wc, mask=cm, other=0.0).to(x_dtype).to(tl.float32)
    w1 = tl.load(w_ptr + c * stride_wc + stride_wk, mask=cm, other=0.0).to(x_dtype).to(tl.float32)
    w2 = tl.load(w_ptr + c * stride_wc + 2 * stride_wk, mask=cm, other=0.0).to(x_dtype).to(tl.float32)
    w3 = tl.load(w_ptr + c * stride_wc + 3 * stride_wk, mask=cm, other=0.0).to(x_dtype).to(tl.float32)
    r1 = _row_in(x_ptr, hist_ptr, t0 - 3, c, cm, L, stride_xt, stride_hc, stride_hl, x_dtype)
    r2 = _row_in(x_ptr, hist_ptr, t0 - 2, c, cm, L, stride_xt, stride_hc, stride_hl, x_dtype)
    r3 = _row_in(x_ptr, hist_ptr, t0 - 1, c, cm, L, stride_xt, stride_hc, stride_hl, x_dtype)
    c0 = tl.program_id(1) * BLOCK_C  # with PARTS a strip lies in one part (BLOCK_C divides P1 and P2)
    start = tl.where(c0 >= P2, P2, tl.where(c0 >= P1, P1, 0))
    width = tl.where(c0 >= P2, C - P2, tl.where(c0 >= P1, P2 - P1, P1))
    x_row = x_ptr + t0.to(tl.int64) * stride_xt + c
    for i in range(0, ROWS, 4):
        r1, r2, r3 = _four_rows(
            x_row + i * stride_xt, out_ptr, t0 + i, T, c, C, start, width, stride_xt, stride_ot,
            r1, r2, r3, w0, w1, w2, w3, SILU, PARTS,
        )  # fmt: skip


@triton.jit
def _four_rows(
    x_row, out_ptr, t, T, c, C, start, width, stride_xt, stride_ot, r1, r2, r3, w0, w1, w2, w3,
    SILU: tl.constexpr, PARTS: tl.constexpr,
):  # fmt: skip
    """Output rows t..t+3 from the three input rows before t (r1, r2, r3, oldest first) and rows t..t+3 at
    x_row; returns the last three of those (the next call's r1, r2, r3)."""
    n0 = tl.load(x_row, mask=c < tl.where(t < T, C, 0), other=0.0).to(tl.float32)
    n1 = tl.load(x_row + stride_xt, mask=c < tl.where(t + 1 < T, C, 0), other=0.0).to(tl.float32)
    n2 = tl.load(x_row + 2 * stride_xt, mask=c < tl.where(t + 2 < T, C, 0), other=0.0).to(tl.float32)
    n3 = tl.load(x_row + 3 * stride_xt, mask=c < tl.where(t + 3 < T, C, 0), other=0.0).to(tl.float32)
    y0 = _tap4(r1, r2, r3, n0, w0, w1, w2, w3, SILU)
    y1 = _tap4(r2, r3, n0, n1, w0, w1, w2, w3, SILU)
    y2 = _tap4(r3, n0, n1, n2, w0, w1, w2, w3, SILU)
    y3 = _tap4(n0, n1, n2, n3, w0, w1, w2, w3, SILU)
    _row_out(out_ptr, t, T, c, C, start, width, stride_ot, y0, PARTS)
    _row_out(out_ptr, t + 1, T, c, C, start, width, stride_ot, y1, PARTS)
    _row_out(out_ptr, t + 2, T, c, C, start, width, stride_ot, y2, PARTS)
    _row_out(out_ptr, t + 3, T, c, C, start, width, stride_ot, y3, PARTS)
    return n1, n2, n3


def triton_conv_chunk(
    x: torch.Tensor,
    history: torch.Tensor,
    weight: torch.Tensor,
    dilation: int = 1,
    silu: bool = False,
    parts: tuple[int, int, int] | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """x [T, C] (any row stride); history [C, L], L = (K-1)*dilation, read only; weight [C, K] ->
    out [T, C] in x.dtype (SiLU applied if `silu`); with `parts` (three widths summing to C) the out's
    three column ranges as contiguous [T, width] tensors."""
    T, C = x.shape
    K = weight.shape[-1]
    assert history.shape == (C, (K - 1) * dilation), (history.shape, C, K, dilation)
    assert parts is None or (len(parts) == 3 and sum(parts) == C), (parts, C)
    x = unit_stride(x)
    out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    P1, P2 = (parts[0], parts[0] + parts[1]) if parts else (0, 0)

    def columns(widest: int) -> int:  # a tile's columns lie in one part: a power of two dividing P1 and P2
        return min(widest, (P1 | P2) & -(P1 | P2)) if P1 | P2 else widest

    assert ROWS % 4 == 0, ROWS
    if T > 0 and (K, dilation) == (4, 1) and ROWS:
        block_c = columns(ROWS_BLOCK_C)
        grid = (triton.cdiv(T, ROWS), triton.cdiv(C, block_c))
        _conv_rows[grid](
            x, history, weight, out, T, C, history.shape[1], P1, P2,
            x.stride(0), history.stride(0), history.stride(1), weight.stride(0), weight.stride(1),
            out.stride(0), SILU=silu, PARTS=parts is not None, ROWS=ROWS, BLOCK_C=block_c,
            num_warps=ROWS_WARPS,
        )  # fmt: skip
    elif T > 0:
        block_c = columns(BLOCK_C)
        grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(C, block_c))
        _conv_chunk[grid](
            x, history, weight, out, T, C, history.shape[1], P1, P2,
            x.stride(0), history.stride(0), history.stride(1), weight.stride(0), weight.stride(1),
            out.stride(0), K=K, DIL=dilation, SILU=silu, PARTS=parts is not None,
            BLOCK_T=BLOCK_T, BLOCK_C=block_c, num_warps=NUM_WARPS,
        )  # fmt: skip
    if parts is None:
        return out
    flat = out.view(-1)
    return [flat[T * a : T * b].view(T, b - a) for a, b in ((0, P1), (P1, P2), (P2, C))]
