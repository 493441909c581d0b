"""Mixture of experts: top-k routing and the routed experts."""

import torch
import torch.nn.functional as F

from .linear import linear
from .pointwise import rowwise


def route(
    logits: torch.Tensor, top_k: int, normalize: bool, row_invariant: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (model dtype) -> (weights [T, k] model dtype, expert ids [T, k])."""
    probs = rowwise(lambda t: torch.softmax(t, dim=-1, dtype=torch.float), logits, row_invariant)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    if normalize:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(logits.dtype), top_i


def experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    row_invariant: bool,
) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H] (gate rows first); down [E, H, I]. Returns sum_k w_k * y_{e_k}.

    # NOTE: contributions are added in ascending expert order, one expert at a time, as the
    # reference model does; in row-invariant mode each row's projections are calls of their own.
    """
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        h = linear(x[tok], gate_up[e], row_invariant)
        g, u = h.chunk(2, dim=-1)
        y = linear(rowwise(F.silu, g, row_invariant) * u, down[e], row_invariant)
        out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
    return out
