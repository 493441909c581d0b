"""Pieces the elementwise kernels share: the sigmoid they all round the same way, and the unit-stride
view their wrappers pass (column slices of a stacked projection are read in place)."""

import torch
import triton
import triton.language as tl


@triton.jit
def sigmoid(v):
    """1 / (1 + exp(-v)) in float32, as torch's CUDA sigmoid computes it before rounding."""
    return 1.0 / (1.0 + tl.exp(-v))


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is contiguous (any row stride), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()
