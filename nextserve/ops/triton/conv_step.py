"""Batched decode step of the depthwise causal conv (one new input per row, history by slot) for CUDA.

Reference: `nextserve.ops.conv.conv_step` on the CPU, a per-row loop over `causal_conv`.

# NOTE: one program per (row, channel tile): a program reads its row's input, its slot's history
# (found through `slots` on the device, so nothing is read to the host and the launch can be captured
# in a CUDA graph), computes the taps in float32 in a fixed order (k = 0..K-1, as `causal_conv`), and
# shifts the history in place. BLOCK_C, K and the dilation are the only compile-time constants; the row
# count only sizes the grid. So a row's output and its slot's new history are the same bits whatever rows
# are beside it and however many there are (C1) - by construction. Slots are distinct, so no two
# programs touch the same history.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start

BLOCK_C = 256
NUM_WARPS = 4  # 128 threads over a 256-channel tile: no element is held by two threads


@triton.jit
def _conv_step(
    x_ptr, state_ptr, slots_ptr, w_ptr, out_ptr, C,
    stride_xb, stride_ss, stride_sc, stride_sl, stride_wc, stride_wk, stride_ob,
    K: tl.constexpr, DIL: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = c < C
    x_dtype = x_ptr.dtype.element_ty
    s_dtype = state_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + b).to(tl.int64)
    hist = state_ptr + slot * stride_ss + c * stride_sc  # column j of the history: hist + j * stride_sl
    x = tl.load(x_ptr + b * stride_xb + c, mask=mask, other=0.0)
    # seq = history ++ x (L + 1 columns, L = (K-1)*DIL); tap k reads column k*DIL, the last tap x.
    # As in `causal_conv`, the history and the weight are first cast to x's dtype.
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for k in tl.static_range(K):
        w = tl.load(w_ptr + c * stride_wc + k * stride_wk, mask=mask, other=0.0).to(x_dtype).to(tl.float32)
        if k == K - 1:
            val = x.to(tl.float32)
        else:
            val = tl.load(hist + (k * DIL) * stride_sl, mask=mask, other=0.0).to(x_dtype).to(tl.float32)
        if k == 0:
            acc = val * w
        else:
            acc = acc + val * w
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + b * stride_ob + c, acc.to(out_ptr.dtype.element_ty), mask=mask)
    # NOTE: in-place shift, new column j = old column j+1 (the last = x). Each channel is held by one
    # thread (no replication at BLOCK_C=256, 4 warps), which reads column j+1 before it overwrites it
    # in the next step; the barrier also orders the tap loads above before any store.
    tl.debug_barrier()
    for j in tl.static_range((K - 1) * DIL):
        if j + 1 < (K - 1) * DIL:
            nxt = tl.load(hist + (j + 1) * stride_sl, mask=mask, other=0.0).to(x_dtype)
        else:
            nxt = x
        tl.store(hist + j * stride_sl, nxt.to(s_dtype), mask=mask)


def triton_conv_step(
    x: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    dilation: int = 1,
    silu: bool = False,
) -> torch.Tensor:
    """x [B, C]; state [S, C, (K-1)*dilation] updated in place at rows `slots` [B] (distinct); weight
    [C, K]. Returns out [B, C] in x.dtype (SiLU applied if `silu`). One launch, no host reads."""
    B, C = x.shape
    K = weight.shape[-1]
    assert state.shape[1:] == (C, (K - 1) * dilation), (state.shape, C, K, dilation)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((B, C), dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    grid = (B, triton.cdiv(C, BLOCK_C))
    _conv_step[grid](
        x, state, slots, weight, out, C,
        x.stride(0), state.stride(0), state.stride(1), state.stride(2), weight.stride(0), weight.stride(1),
        out.stride(0),
        K=K, DIL=dilation, SILU=silu, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS, **pdl_args(x),
    )  # fmt: skip
    return out
