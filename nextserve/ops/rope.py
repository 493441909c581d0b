"""Rotary position embedding (NeoX rotate-half on the first rotary_dim dims)."""

import torch

from .triton import use_kernel


def inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    # NOTE: same float32 arithmetic as the reference model, so cos/sin match it bit for bit.
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def cos_sin(
    positions: torch.Tensor, inv_f: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, rotary_dim] in `dtype` (computed in float32).

    Text-only MRoPE has equal T/H/W positions, so it is plain 1-D RoPE."""
    freqs = positions[:, None].float() * inv_f.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, rot] with rot <= D. One Triton launch on CUDA (ops/triton/rope.py);
    the code below is its reference and the CPU path."""
    if use_kernel(x, cos, sin) and x.dtype == cos.dtype == sin.dtype and cos.shape[-1] % 2 == 0:
        from .triton.rope import triton_apply_rope

        return triton_apply_rope(x, cos, sin)
    rot = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * c + _rotate_half(x_rot) * s, x_pass], dim=-1)
