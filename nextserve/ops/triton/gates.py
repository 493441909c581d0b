"""Small gating kernels for CUDA, each replacing a chain of torch elementwise launches in a step:
the GDN gates (beta, g), the shared expert's silu(gate) * up, and x * sigmoid(gate) (+ a residual).

References (the CPU paths): `gdn_gates` in nextserve/ops/gdn.py, `silu_mul` and `sigmoid_gate` in
nextserve/ops/pointwise.py.

# NOTE: every kernel is elementwise over (row, column): a program handles BLOCK columns of one row, the
# block size and warp count are constants, and the row count only sizes the grid (not specialised on),
# so an element's bits never depend on the rows beside it (C1). They follow the reference's dtype
# semantics: each op computed in float32 and rounded to the model dtype where torch rounds. Inputs may
# be column slices of a stacked projection (a row stride, unit column stride): no copy is made. Nothing
# is read to the host (graph-capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start, sigmoid, unit_stride

BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _log1p(y):
    # log1p without libdevice (which Triton's interpreter lacks): log(u) * y / (u - 1), u = 1 + y, is
    # accurate to a few ulp where log(1 + y) loses y's low bits (Goldberg's method).
    u = 1.0 + y
    return tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))


@triton.jit(do_not_specialize=["T"])
def _gdn_gates(
    b_ptr, a_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, T, HV, stride_b, stride_a,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = h < HV
    b = tl.load(b_ptr + t * stride_b + h, mask=m, other=0.0).to(tl.float32)
    tl.store(beta_ptr + t * HV + h, sigmoid(b).to(beta_ptr.dtype.element_ty), mask=m)
    x = tl.load(a_ptr + t * stride_a + h, mask=m, other=0.0).to(tl.float32)
    x += tl.load(dtb_ptr + h, mask=m, other=0.0).to(tl.float32)
    softplus = tl.where(x > 20.0, x, _log1p(tl.exp(x)))  # torch's threshold (beta 1)
    a_log = tl.load(alog_ptr + h, mask=m, other=0.0).to(tl.float32)
    tl.store(g_ptr + t * HV + h, -tl.exp(a_log) * softplus, mask=m)


@triton.jit(do_not_specialize=["T"])
def _silu_mul(g_ptr, u_ptr, o_ptr, T, N, stride_g, stride_u, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    ty = o_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    g = tl.load(g_ptr + t * stride_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t * stride_u + c, mask=m, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)  # silu rounded, as F.silu's output is
    tl.store(o_ptr + t * N + c, (act * u).to(ty), mask=m)


@triton.jit(do_not_specialize=["T"])
def _sigmoid_gate(
    x_ptr, gate_ptr, add_ptr, o_ptr, T, N, HD, stride_x, stride_g, stride_gh, stride_add,
    BLOCK: tl.constexpr, ROW_GATE: tl.constexpr, ADD: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    ty = o_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    x = tl.load(x_ptr + t * stride_x + c, mask=m, other=0.0).to(tl.float32)
    if ROW_GATE:
        g = tl.load(gate_ptr + t * stride_g).to(tl.float32)
    else:
        g_col = (c // HD) * stride_gh + c % HD  # column c of a gate cut in heads of HD columns
        g = tl.load(gate_ptr + t * stride_g + g_col, mask=m, other=0.0).to(tl.float32)
    y = (x * sigmoid(g).to(ty).to(tl.float32)).to(ty)
    if ADD:
        r = tl.load(add_ptr + t * stride_add + c, mask=m, other=0.0).to(tl.float32)
        y = (r + y.to(tl.float32)).to(ty)
    tl.store(o_ptr + t * N + c, y, mask=m)


def _grid(T: int, N: int) -> tuple[int, int]:
    return (T, triton.cdiv(N, BLOCK))


def triton_gdn_gates(
    b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a [T, Hv] (model dtype) -> (g [T, Hv] float32, beta [T, Hv] in b's dtype)."""
    b, a = unit_stride(b), unit_stride(a)
    T, HV = b.shape
    g = torch.empty((T, HV), dtype=torch.float32, device=b.device)
    beta = torch.empty((T, HV), dtype=b.dtype, device=b.device)
    if T:
        _gdn_gates[_grid(T, HV)](
            b, a, a_log, dt_bias, g, beta, T, HV, b.stride(0), a.stride(0),
            BLOCK=BLOCK, num_warps=NUM_WARPS, **pdl_args(b),
        )  # fmt: skip
    return g, beta


def triton_silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for g, u [T, N] (one dtype), each op rounded to it."""
    g, u = unit_stride(g), unit_stride(u)
    T, N = g.shape
    out = torch.empty((T, N), dtype=g.dtype, device=g.device)
    if T:
        _silu_mul[_grid(T, N)](
            g, u, out, T, N, g.stride(0), u.stride(0), BLOCK=BLOCK, num_warps=NUM_WARPS, **pdl_args(g)
        )
    return out


def triton_sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """[add +] x * sigmoid(gate) for x [T, N], gate [T, N], [T, heads, N / heads] (a head-split slice of
    a stacked projection, read in place) or [T, 1] (one per row), add [T, N]; each op rounded to x's
    dtype."""
    x, gate = unit_stride(x), unit_stride(gate)
    T, N = x.shape
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T:
        plus = unit_stride(add) if add is not None else x
        heads = gate.shape[1] if gate.dim() == 3 else 1
        assert gate.dim() == 2 or heads * gate.shape[2] == N, (gate.shape, N)
        _sigmoid_gate[_grid(T, N)](
            x, gate, plus, out, T, N, gate.shape[-1], x.stride(0), gate.stride(0),
            gate.stride(1) if heads > 1 else 0, plus.stride(0),
            BLOCK=BLOCK, ROW_GATE=gate.shape[-1] == 1 and heads == 1 and N > 1, ADD=add is not None,
            num_warps=NUM_WARPS, **pdl_args(x),
        )  # fmt: skip
    return out
