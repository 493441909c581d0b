"""Hyper-connection elementwise ops: the mixer's low-rank activation, the stream mix, the injection.

# On CUDA (bf16/fp16/fp32, one dtype) each is one fused Triton kernel (ops/triton/hyper.py): the mixer's
# sigmoid is folded into the stream mix and the injection gate 2 sigmoid(v / n) into the injection, both
# row-invariant by construction. The torch code below is their reference (and the CPU path).
"""

import torch
import torch.nn.functional as F

from .linear import linear
from .pointwise import rowwise
from .triton import use_kernel


def _triton_ok(*ts: torch.Tensor) -> bool:
    return use_kernel(*ts) and all(t.dtype == ts[0].dtype for t in ts)


def scaled_silu(v: torch.Tensor, n: int, row_invariant: bool = False) -> torch.Tensor:
    """silu(v / n): the mixer's low-rank activation."""
    if _triton_ok(v):
        from .triton.hyper import triton_scaled_silu

        return triton_scaled_silu(v, n)
    return rowwise(F.silu, v / n, row_invariant)


def down_silu(
    xn: torch.Tensor, weight: torch.Tensor, rank: int, n: int, row_invariant: bool = False
) -> torch.Tensor:
    """xn [T, K] @ weight[N, K]^T with silu(y / n) on its first `rank` columns: the mixer's low-rank
    activation next to the injection logits of the same projection (one GEMV launch on CUDA in
    row-invariant mode, with scaled_silu's roundings)."""
    if row_invariant and _triton_ok(xn, weight):
        from .triton.gemv import small_m_linear

        return small_m_linear(xn, weight, silu_cols=rank, silu_scale=1.0 / n)
    y = linear(xn, weight, row_invariant)
    if rank >= y.shape[-1]:
        return scaled_silu(y, n, row_invariant)
    return torch.cat([scaled_silu(y[:, :rank], n, row_invariant), y[:, rank:]], dim=-1)


def mix_streams(
    logits: torch.Tensor, xn: torch.Tensor, n: int, hidden: int, row_invariant: bool = False
) -> torch.Tensor:
    """Block input u [T, H] = mean over the n streams of sigmoid(logits) * xn; logits, xn [T, n*H]."""
    if _triton_ok(logits, xn) and logits.shape == xn.shape:
        from .triton.hyper import triton_mix_streams

        return triton_mix_streams(logits, xn, n, hidden, sigmoid=True)
    gate = rowwise(torch.sigmoid, logits, row_invariant)  # [T, nH]
    return (gate.unflatten(-1, (n, hidden)) * xn.unflatten(-1, (n, hidden))).mean(dim=-2)


def up_mix(
    a: torch.Tensor, w_up: torch.Tensor, xn: torch.Tensor, n: int, hidden: int, row_invariant: bool = False
) -> torch.Tensor:
    """The block input u [T, H] = mix_streams(a @ w_up^T, xn): the mixer's up projection of its low-rank
    activation a [T, r] and the stream mix (one launch on CUDA in row-invariant mode: the same bits in 16-bit
    dtypes, equal to rounding in float32, gemv.small_m_linear_mix)."""
    if row_invariant and _triton_ok(a, w_up, xn):
        from .triton.gemv import small_m_linear_mix

        u = small_m_linear_mix(a, w_up, xn, n, hidden)
        if u is not None:
            return u
    return mix_streams(linear(a, w_up, row_invariant), xn, n, hidden, row_invariant)


def inject(
    x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, n: int, row_invariant: bool = False
) -> torch.Tensor:
    """X_s + inj_s * y per stream, inj = 2 sigmoid(v / n): x [T, n*H], block output y [T, H], v [T, n]."""
    if _triton_ok(x, y, v):
        from .triton.hyper import triton_inject

        return triton_inject(x, y, v, n, from_logits=True)
    inj = 2 * rowwise(torch.sigmoid, v / n, row_invariant)  # [T, n]
    return x + (y.unsqueeze(-2) * inj.unsqueeze(-1)).flatten(-2)
