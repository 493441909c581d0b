"""The 8-bit KV planes in the QSA kernels (ops/kv_int8.py): a plane's launch arguments, and the in-kernel
dequantization that gives the PyTorch reference's values bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv_int8 import Int8Plane
from .common import unit_stride


def int8_args(plane) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(values, scales, int8) of a plane for a kernel launch: an Int8Plane's int8 values and float32 scales
    (scales [...] of values [..., D], each vector's one); a 16-bit plane itself twice (its scale pointer is
    never read: KV_INT8 is off)."""
    if isinstance(plane, Int8Plane):
        values, scale = unit_stride(plane.values), plane.scale
        assert scale.stride(-1) == 1 and scale.dim() == values.dim() - 1, scale.stride()
        return values, scale, True
    plane = unit_stride(plane)
    return plane, plane, False


@triton.jit
def dequantize_rows(q, scale, dtype: tl.constexpr):
    """int8 values [R, D] and their float32 scales [R] -> [R, D] in dtype: q * scale in float32, rounded
    once to dtype (ops/kv_int8.dequantize_rows)."""
    return (q.to(tl.float32) * scale[:, None]).to(dtype)
