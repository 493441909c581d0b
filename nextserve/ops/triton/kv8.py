"""The 8-bit KV planes in the QSA kernels (ops/kv8.py): a plane's launch arguments, and the in-kernel
dequantization that gives the PyTorch reference's values bit for bit (int8 and E4M3 codes alike: each code
is a float32 value exactly)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv8 import Kv8Plane
from .common import unit_stride


def kv8_args(plane) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(codes, scales, 8-bit) of a plane for a kernel launch: a Kv8Plane's codes (int8 or E4M3) and float32
    scales (scales [...] of codes [..., D], each vector's one); a 16-bit plane itself twice (its scale pointer
    is never read: KV8 is off)."""
    if isinstance(plane, Kv8Plane):
        values, scale = unit_stride(plane.values), plane.scale
        assert scale.stride(-1) == 1 and scale.dim() == values.dim() - 1, scale.stride()
        return values, scale, True
    plane = unit_stride(plane)
    return plane, plane, False


@triton.jit
def dequantize_rows(q, scale, dtype: tl.constexpr):
    """8-bit codes [R, D] and their float32 scales [R] -> [R, D] in dtype: q * scale in float32, rounded
    once to dtype (ops/kv8.dequantize_rows)."""
    return (q.to(tl.float32) * scale[:, None]).to(dtype)
