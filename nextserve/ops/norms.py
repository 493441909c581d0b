"""RMS norms. Both compute in float32 whatever the model dtype, as the reference model does.

# On CUDA (bf16/fp16/fp32) each is one Triton kernel call (ops/triton/norms.py), row-invariant by
# construction; the torch code below is its reference (and the CPU path).
"""

import torch
import torch.nn.functional as F

from .pointwise import rowwise
from .triton import KERNEL_DTYPES, use_kernel


def _triton_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return use_kernel(x) and weight.dtype in KERNEL_DTYPES


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int | None = None) -> torch.Tensor:
    """G-norm: x * rsqrt(mean(x^2) + eps) * (1 + w), per `group`-sized slice of the last dim."""
    if _triton_ok(x, weight) and weight.numel() == x.shape[-1]:
        from .triton.norms import triton_rms_norm

        return triton_rms_norm(x, weight, eps, group)
    xf = x.float()
    if group is not None:
        xf = xf.reshape(*xf.shape[:-1], -1, group)
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if group is not None:
        out = out.flatten(-2)
    return (out * (1.0 + weight.float())).type_as(x)


def rms_norm_gated(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    act: str,
    row_invariant: bool = False,
) -> torch.Tensor:
    """P-norm of x (plain weight), times act(gate); the GDN output norm."""
    if _triton_ok(x, weight) and weight.numel() == x.shape[-1] and gate.shape == x.shape:
        from .triton.norms import triton_rms_norm_gated

        return triton_rms_norm_gated(x, gate, weight, eps, act)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    g = gate.float()
    out = out * rowwise(torch.sigmoid if act == "sigmoid" else F.silu, g, row_invariant)
    return out.to(dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
