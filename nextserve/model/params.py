"""Parameter holders named like the checkpoint, so state-dict keys match transformers' names.

A `Projection` is a weight only ever used through `ops.linear` (or the expert ops, for `Experts`): it may
hold block-wise FP8 values (`to_fp8`, then `weight` is float8_e4m3fn and `weight_scale_inv` its float32
block scales, the checkpoint's names), and its `operand` is what the ops take. Any other weight (norms,
convolutions, embeddings, the hyper-connections' mixing projections) is always in the model dtype: an FP8
checkpoint's values for it are dequantized when loaded.
"""

import torch
from torch import nn

from ..ops.fp8 import BLOCK, FP8, Fp8Weight, scale_shape
from ..ops.linear import linear


class Weight(nn.Module):
    """A module with one `weight` (a projection matrix or a norm vector); its op is called elsewhere."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape), requires_grad=False)

    @property
    def operand(self) -> torch.Tensor | Fp8Weight:
        """The weight as the ops take it (an Fp8Weight when stored in FP8: Projection only)."""
        return operand_of(self, "weight")


def fp8_parameters(module: nn.Module, name: str) -> None:
    """Turn module's parameter `name` into an empty FP8 one with `{name}_scale_inv` beside it (a loader
    fills both)."""
    p = getattr(module, name)
    setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=FP8, device=p.device), requires_grad=False))
    scale = torch.empty(scale_shape(tuple(p.shape)), dtype=torch.float32, device=p.device)
    module.register_parameter(f"{name}_scale_inv", nn.Parameter(scale, requires_grad=False))


def operand_of(module: nn.Module, name: str) -> torch.Tensor | Fp8Weight:
    p = getattr(module, name)
    return Fp8Weight(p, getattr(module, f"{name}_scale_inv")) if p.dtype == FP8 else p


class Projection(Weight):
    """A projection matrix [N, K], which may be stored in FP8 (the module docstring)."""

    def to_fp8(self) -> None:
        fp8_parameters(self, "weight")


def fuse_rows(*holders: Weight) -> torch.Tensor | Fp8Weight | None:
    """Stack the weights [N_i, K] of projections that read the same input into one [sum N_i, K], each
    holder's weight becoming a view of its rows: one GEMV launch instead of several in a decode step, and
    no second copy of the weights. Returns the stack; None (nothing changed) when the holders do not stack:
    FP8 and plain weights together, or FP8 ones whose boundaries split a 128-row scale block."""
    ops = [h.operand for h in holders]
    fp8 = [isinstance(w, Fp8Weight) for w in ops]
    if not any(fp8):
        fused = torch.cat([h.weight.data for h in holders])
        _share_rows(holders, fused, "weight")
        return fused
    if not all(fp8) or any(h.weight.shape[0] % BLOCK for h in holders[:-1]):
        return None
    q = torch.cat([h.weight.data for h in holders])
    scale = torch.cat([h.weight_scale_inv.data for h in holders])
    _share_rows(holders, q, "weight")
    _share_rows(holders, scale, "weight_scale_inv", block=BLOCK)
    return Fp8Weight(q, scale)


def _share_rows(holders, fused: torch.Tensor, name: str, block: int = 1) -> None:
    start = 0
    for h in holders:
        p = getattr(h, name)
        n = -(-h.weight.shape[0] // block)
        p.data = fused[start : start + n]
        start += n


def project(
    x: torch.Tensor, holders: tuple[Weight, ...], stacked: torch.Tensor | Fp8Weight | None, ri: bool
) -> tuple[torch.Tensor, ...]:
    """x through each holder's projection: one GEMV over their `fuse_rows` stack when there is one."""
    if stacked is not None:
        return linear(x, stacked, ri).split([h.weight.shape[0] for h in holders], dim=-1)
    return tuple(linear(x, h.operand, ri) for h in holders)
