"""The depthwise causal conv of a prefill chunk for CUDA: all T rows in one launch.
Reference: `nextserve.ops.conv.conv_chunk` on the CPU (`causal_conv`, then SiLU).

The torch reference runs a tap at a time over the whole chunk (K products and K-1 sums of [T, C], each a
pass over memory in the model dtype, the products over a strided weight column): 65-110 ms of a 62.7K
prompt's prefill at 8 layers. Here a program computes a tile of rows and channels, reading each input
once per tap from L2, the taps in float32 in a fixed order (k = 0..K-1) with SiLU fused, as the decode
step (`conv_step.py`) does: equal to the reference to rounding.

# NOTE: tiles and warps are constants and T only sizes the grid: an element's bits depend on its own
# inputs alone, so a chunk's result is the chunk's (C1). The history is only read here (the caller
# stores the new one), so no program races another.

With `parts` the output's column ranges [0, P1), [P1, P2), [P2, C) are stored one after another, each a
contiguous [T, width] block (the GDN's q, k and v, which fla's chunked kernels read contiguous: they
copied the column slices, 9.4 ms of a 62.7K-token prefill's kernels on the H200, session 21). Where an
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
    # a tile's columns lie in one part: the widest power of two up to BLOCK_C that divides P1 and P2
    block_c = min(BLOCK_C, (P1 | P2) & -(P1 | P2)) if P1 | P2 else BLOCK_C
    if T > 0:
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
