"""Hyper-connection elementwise kernels for CUDA: the mixer's activation, the stream mix, the injection.

Reference: `nextserve.ops.hyper` on the CPU (scaled_silu, mix_streams, inject).

# NOTE: each kernel is elementwise over a row's columns, with the n streams summed in a fixed order
# (s = 0..n-1, unrolled) inside the program; the block size and warp count are constants, and the row
# count only sizes the grid. So an element's bits never depend on the rows beside it (C1). They follow
# the reference's dtype semantics: every op the reference does in the model dtype is done in float32 and
# rounded to the model dtype where the reference rounds (the mean over streams accumulates in float32
# and is rounded once, as torch's reduction does). Nothing is read to the host (graph-capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start, sigmoid, unit_stride

BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _scaled_silu(v_ptr, o_ptr, N, stride_v, inv_n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    ty = o_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    v = (tl.load(v_ptr + t * stride_v + c, mask=m, other=0.0).to(tl.float32) * inv_n).to(ty).to(tl.float32)
    tl.store(o_ptr + t * N + c, (v / (1.0 + tl.exp(-v))).to(ty), mask=m)  # silu(v / n)


@triton.jit
def _mix_streams(
    g_ptr, x_ptr, u_ptr, H, stride_g, stride_x, stride_u, inv_n,
    N: tl.constexpr, BLOCK: tl.constexpr, SIGMOID: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    ty = u_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(N):
        g = tl.load(g_ptr + t * stride_g + s * H + c, mask=m, other=0.0).to(tl.float32)
        if SIGMOID:
            g = sigmoid(g).to(ty).to(tl.float32)
        x = tl.load(x_ptr + t * stride_x + s * H + c, mask=m, other=0.0).to(tl.float32)
        acc += (g * x).to(ty).to(tl.float32)
    tl.store(u_ptr + t * stride_u + c, (acc * inv_n).to(ty), mask=m)


@triton.jit
def _inject(
    x_ptr, y_ptr, v_ptr, o_ptr, H, stride_x, stride_y, stride_v, stride_o, inv_n,
    BLOCK: tl.constexpr, FROM_LOGITS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    # NOTE: one program per (row, column block, stream): its loads are not queued behind another
    # stream's store (which the compiler may not reorder them past)
    pdl_start(PDL)
    ty = o_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    s = tl.program_id(2)
    m = c < H
    y = tl.load(y_ptr + t * stride_y + c, mask=m, other=0.0).to(tl.float32)
    inj = tl.load(v_ptr + t * stride_v + s).to(tl.float32)
    x = tl.load(x_ptr + t * stride_x + s * H + c, mask=m, other=0.0).to(tl.float32)
    if FROM_LOGITS:
        inj = (inj * inv_n).to(ty).to(tl.float32)  # v / n
        inj = 2.0 * sigmoid(inj).to(ty).to(tl.float32)  # exact doubling
    p = (y * inj).to(ty).to(tl.float32)
    tl.store(o_ptr + t * stride_o + s * H + c, (x + p).to(ty), mask=m)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    return unit_stride(t.reshape(-1, width))


def triton_scaled_silu(v: torch.Tensor, n: int) -> torch.Tensor:
    """silu(v / n), each op rounded to v's dtype as torch does; any shape (the rows of a column slice
    are read in place)."""
    N = v.shape[-1]
    v2 = _rows(v, N)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if v2.shape[0] and N:
        block = min(BLOCK, triton.next_power_of_2(N))
        _scaled_silu[(v2.shape[0], triton.cdiv(N, block))](
            v2, o, N, v2.stride(0), 1.0 / n, BLOCK=block, num_warps=NUM_WARPS, **pdl_args(v2)
        )  # fmt: skip
    return o


def triton_mix_streams(
    gate: torch.Tensor, xn: torch.Tensor, n: int, hidden: int, sigmoid: bool = False
) -> torch.Tensor:
    """mean over the n streams of gate * xn: gate, xn [..., n*hidden] (one dtype) -> u [..., hidden].
    With sigmoid=True `gate` holds logits and sigmoid(gate) is taken first (rounded to the dtype)."""
    assert gate.shape == xn.shape and gate.dtype == xn.dtype and xn.shape[-1] == n * hidden
    g2, x2 = _rows(gate, n * hidden), _rows(xn, n * hidden)
    u = torch.empty((*xn.shape[:-1], hidden), dtype=xn.dtype, device=xn.device)
    if x2.shape[0]:
        block = min(BLOCK, triton.next_power_of_2(hidden))
        _mix_streams[(x2.shape[0], triton.cdiv(hidden, block))](
            g2, x2, u, hidden, g2.stride(0), x2.stride(0), hidden, 1.0 / n,
            N=n, BLOCK=block, SIGMOID=sigmoid, num_warps=NUM_WARPS, **pdl_args(g2),
        )  # fmt: skip
    return u


def triton_inject(
    x: torch.Tensor, y: torch.Tensor, inj: torch.Tensor, n: int, from_logits: bool = False
) -> torch.Tensor:
    """x [..., n*H] + y [..., H] * inj [..., n] per stream (one dtype) -> [..., n*H]. With
    from_logits=True `inj` holds the projection v and inj = 2 sigmoid(v / n) is taken first."""
    hidden = y.shape[-1]
    assert x.shape[-1] == n * hidden and inj.shape[-1] == n, (x.shape, y.shape, inj.shape)
    assert x.dtype == y.dtype == inj.dtype, (x.dtype, y.dtype, inj.dtype)
    x2, y2, v2 = _rows(x, n * hidden), _rows(y, hidden), _rows(inj, n)
    assert x2.shape[0] == y2.shape[0] == v2.shape[0], (x.shape, y.shape, inj.shape)
    o = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(BLOCK, triton.next_power_of_2(hidden))
        _inject[(x2.shape[0], triton.cdiv(hidden, block), n)](
            x2, y2, v2, o, hidden, x2.stride(0), y2.stride(0), v2.stride(0), n * hidden, 1.0 / n,
            BLOCK=block, FROM_LOGITS=from_logits, num_warps=NUM_WARPS, **pdl_args(x2),
        )  # fmt: skip
    return o
