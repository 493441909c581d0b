"""RMS norms (G-norm `rms_norm`, gated P-norm `rms_norm_gated`) for CUDA, one launch per call.

Reference: `nextserve.ops.norms.rms_norm` / `rms_norm_gated` on the CPU.

# NOTE: the input is viewed as rows of the last dim D, each cut into D // G slices of G (G = group, or D);
# a program normalises ROWS whole slices, one per row of its [ROWS, BLOCK] tile: it loads a slice, sums
# its squares in float32 inside the program (tl.sum along the tile's row), scales by rsqrt(mean + eps)
# and the weight, and stores it. The tile (BLOCK = next power of two of G, ROWS) and the warp count
# depend on G only, never on the row count, which only sizes the grid and masks the last tile (the slice
# count S is not specialised on, so one compiled kernel serves every row count); every tile row is reduced
# by the same instruction sequence. So a slice's bits are the same whatever rows are beside it and however
# many there are (C1) - by construction. Nothing is read to the host, so a launch can be captured. Rows
# are addressed through an [R0, R1, D] view with two strides, so a head-split slice of a stacked projection
# ([T, heads, D], a token's rows a projection's width apart) is read in place rather than copied (those
# copies took 9.5 ms of a 62.7K-token prefill's kernels on the H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start

MAX_BLOCK = 1 << 16  # slices longer than this would spill; no model norm comes near it (joint n*H = 10240)
TILE = 1024  # elements of a program's tile when slices are short (several slices per program)


@triton.jit(do_not_specialize=["S", "R1"])  # one compiled kernel whatever the row count and row grouping
def _rms_norm(
    x_ptr, w_ptr, g_ptr, y_ptr,
    S, SPR, G, R1, stride_x0, stride_x1, stride_g0, stride_g1, inv_g, eps,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, GATED: tl.constexpr, SIGMOID: tl.constexpr,
    ROUND_PROD: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    out_ty = y_ptr.dtype.element_ty
    s = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # slice ids
    row = (s // SPR).to(tl.int64)
    outer, inner = row // R1, row % R1  # the row's place in the [R0, R1, D] view
    col0 = (s % SPR) * G  # the slice's first column in its row (and in the weight)
    c = tl.arange(0, BLOCK)
    mask = (s < S)[:, None] & (c < G)[None, :]
    cols = col0[:, None] + c[None, :]
    x_row = outer * stride_x0 + inner * stride_x1
    x = tl.load(x_ptr + x_row[:, None] + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=1) * inv_g + eps)
    xn = x * r[:, None]
    if GATED:
        # out = weight * normed.to(dtype) [in promote(weight, dtype)]; out * act(gate.float()); .to(dtype)
        o = w * xn.to(out_ty).to(tl.float32)
        if ROUND_PROD:
            o = o.to(out_ty).to(tl.float32)
        g_row = outer * stride_g0 + inner * stride_g1
        gt = tl.load(g_ptr + g_row[:, None] + cols, mask=mask, other=0.0).to(tl.float32)
        if SIGMOID:
            a = 1.0 / (1.0 + tl.exp(-gt))
        else:
            a = gt / (1.0 + tl.exp(-gt))
        o = o * a
    else:
        o = xn * (1.0 + w)
    tl.store(y_ptr + row[:, None] * (SPR * G) + cols, o.to(out_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [R0, R1, D] rows (R1 = 1 for a 2D t), a view where t's strides allow: a head-split slice of a
    stacked projection [T, heads, D] is read in place (its reshape to [T * heads, D] would copy)."""
    t3 = t.reshape(-1, 1, t.shape[-1]) if t.dim() <= 2 else t.reshape(-1, t.shape[-2], t.shape[-1])
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def _launch(x, weight, gate, eps, G, sigmoid, round_prod):
    D = x.shape[-1]
    assert G > 0 and D % G == 0, (x.shape, G)
    assert weight.numel() == D, (weight.shape, D)
    assert G <= MAX_BLOCK, G
    x3 = _rows(x)
    w = weight.reshape(D).contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if gate is None:
        g3 = x3  # unused
    else:
        assert gate.shape == x.shape, (gate.shape, x.shape)
        g3 = _rows(gate)
    spr = D // G
    S = x3.shape[0] * x3.shape[1] * spr
    if S == 0:
        return y
    block = triton.next_power_of_2(G)
    rows = max(1, TILE // block)
    num_warps = max(1, min(16, rows * block // 256))
    _rms_norm[(triton.cdiv(S, rows),)](
        x3, w, g3, y,
        S, spr, G, x3.shape[1], x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1), 1.0 / G, eps,
        ROWS=rows, BLOCK=block, GATED=gate is not None, SIGMOID=sigmoid, ROUND_PROD=round_prod,
        num_warps=num_warps, **pdl_args(x3),
    )  # fmt: skip
    return y


def triton_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, group: int | None = None
) -> torch.Tensor:
    """G-norm x * rsqrt(mean(x^2) + eps) * (1 + w) in float32, per `group`-sized slice of the last dim
    (the whole last dim when None); weight [D] over the whole last dim; any leading dims; x's dtype."""
    return _launch(x, weight, None, eps, group or x.shape[-1], False, False)


def triton_rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, act: str
) -> torch.Tensor:
    """P-norm of x over the last dim (plain weight), times act(gate) ("sigmoid" or "silu") in float32,
    with the reference's cast points; gate has x's shape; x's dtype."""
    round_prod = torch.promote_types(weight.dtype, x.dtype) == x.dtype and x.dtype != torch.float32
    return _launch(x, weight, gate, eps, x.shape[-1], act == "sigmoid", round_prod)
