"""Pending token ids resolved on the device, in one launch (CUDA graphs replay it before the embedding).
Reference: `resolve_pending_ids` in nextserve/ops/tokens.py (the CPU path), three torch launches."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start


@triton.jit
def _resolve(ids_ptr, tokens_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(ids_ptr + offs, mask=m, other=0)
    pending = v < 0
    t = tl.load(tokens_ptr + tl.where(pending, -1 - v, 0), mask=m & pending, other=0)
    tl.store(ids_ptr + offs, tl.where(pending, t, v), mask=m)


def triton_resolve_pending_ids(ids: torch.Tensor, tokens: torch.Tensor) -> None:
    """See nextserve.ops.tokens.resolve_pending_ids."""
    assert ids.dim() == 1 and ids.stride(0) == 1, ids.stride()
    n, block = ids.numel(), 256
    if n:
        _resolve[(triton.cdiv(n, block),)](ids, tokens, n, BLOCK=block, num_warps=1, **pdl_args(ids))
