"""Parameter holders named like the checkpoint, so state-dict keys match transformers' names."""

import torch
from torch import nn

from ..ops.linear import linear


class Weight(nn.Module):
    """A module with one `weight` (a projection matrix or a norm vector); its op is called elsewhere."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape), requires_grad=False)


def fuse_rows(*holders: Weight) -> torch.Tensor:
    """Stack the weights [N_i, K] of projections that read the same input into one [sum N_i, K]
    tensor, each holder's weight becoming a view of its rows: one GEMV launch instead of several
    in a decode step, and no second copy of the weights. Returns the stacked tensor."""
    fused = torch.cat([h.weight.data for h in holders])
    start = 0
    for h in holders:
        n = h.weight.shape[0]
        h.weight.data = fused[start : start + n]
        start += n
    return fused


def project(
    x: torch.Tensor, holders: tuple[Weight, ...], stacked: torch.Tensor | None, ri: bool
) -> tuple[torch.Tensor, ...]:
    """x through each holder's projection: one GEMV over their `fuse_rows` stack when there is one."""
    if stacked is not None:
        return linear(x, stacked, ri).split([h.weight.shape[0] for h in holders], dim=-1)
    return tuple(linear(x, h.weight, ri) for h in holders)
