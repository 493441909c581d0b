"""Token ids on the device: the greedy argmax of a step's logits, and the ids a decode step reads. With
async scheduling (engine/engine.py) a step is launched before the host has read the previous step's
sampled tokens, so its rows name them instead.

# NOTE: a row's id is either a token (>= 0) or -(1 + r): the token the previous step sampled in its row r,
# which is still on the device (`tokens`, the argmax buffer every decode step writes). Resolving reads
# only that row, so a row's bits never depend on the rows beside it (C1).
"""

import torch

from .triton import use_kernel


def resolve_pending_ids(ids: torch.Tensor, tokens: torch.Tensor) -> None:
    """ids [n] int64, in place: each -(1 + r) becomes tokens[r] (tokens [>= r + 1] int64)."""
    if use_kernel(ids, tokens, dtypes=(torch.int64,)):
        from .triton.tokens import triton_resolve_pending_ids

        triton_resolve_pending_ids(ids, tokens)
        return
    src = (-1 - ids).clamp(min=0)
    ids.copy_(torch.where(ids >= 0, ids, tokens[src]))


def greedy_ids(logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [M] int64 = logits [M, V].argmax(-1) (the first index of the maximum), returned."""
    if use_kernel(logits):
        from .triton.tokens import triton_greedy_ids

        if triton_greedy_ids(logits, out):
            return out
    return torch.argmax(logits, dim=-1, out=out)
