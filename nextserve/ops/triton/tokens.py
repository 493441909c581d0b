"""Token ids on the device: pending ids resolved in one launch (CUDA graphs replay it before the embedding),
and the greedy argmax of logits rows in one launch. References: `resolve_pending_ids` and `greedy_ids` in
nextserve/ops/tokens.py (the CPU path).

# NOTE: the argmax splits a row into fixed chunks (never chosen from M); each program reads its row's
# logits only, and the row's last program reduces the chunks' partials in chunk order through the tile
# counters (common.py), as gemv's one-launch split reduction does. Its result is torch.argmax's: the
# first index of the maximum (NaN counting as the maximum; where +inf precedes a NaN it returns the +inf,
# which torch does not: a model that gives NaN logits is broken either way). The torch reduction took
# ~9 us a step at a 248K vocabulary on an H200."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start, tile_counters


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


ARGMAX_BLOCK = 4096  # logits a program reads; a 248K vocabulary is 61 programs a row


@triton.jit
def _argmax(
    x_ptr, part_v_ptr, part_i_ptr, cnt_ptr, out_ptr, V, stride_x,
    BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk): the chunk's max and its first index; the row's last program to finish picks
    the largest of the chunks' maxima, the first chunk among equals (the lowest index)."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    n = tl.num_programs(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    v = tl.where(v != v, float("inf"), v)  # NaN is the largest, as in torch.argmax
    best = tl.max(v, axis=0)
    first = tl.min(tl.where(v == best, offs, 2147483647), axis=0)
    tl.store(part_v_ptr + row * n + c, best)
    tl.store(part_i_ptr + row * n + c, first)
    tl.debug_barrier()  # the partials are stored before the release below
    arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    if arrived == n - 1:
        k = tl.arange(0, CHUNKS_PAD)
        pv = tl.load(part_v_ptr + row * n + k, mask=k < n, other=float("-inf"), cache_modifier=".cg")
        pi = tl.load(part_i_ptr + row * n + k, mask=k < n, other=2147483647, cache_modifier=".cg")
        top = tl.max(pv, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(pv == top, pi, 2147483647), axis=0).to(tl.int64))
        tl.atomic_xchg(cnt_ptr + row, 0)


def triton_greedy_ids(logits: torch.Tensor, out: torch.Tensor) -> bool:
    """out [M] int64 = logits [M, V].argmax(-1) in one launch; False (nothing launched) where the tile
    counters are not available (a graph capture before any eager call) or too few."""
    M, V = logits.shape
    cnt = tile_counters(logits.device)
    if cnt is None or M > cnt.numel() or logits.stride(-1) != 1:
        return False
    if M == 0:
        return True
    chunks = triton.cdiv(V, ARGMAX_BLOCK)
    part_v = torch.empty((M, chunks), dtype=torch.float32, device=logits.device)
    part_i = torch.empty((M, chunks), dtype=torch.int32, device=logits.device)
    _argmax[(M, chunks)](
        logits, part_v, part_i, cnt, out, V, logits.stride(0), BLOCK=ARGMAX_BLOCK,
        CHUNKS_PAD=triton.next_power_of_2(chunks), num_warps=4, **pdl_args(logits),
    )  # fmt: skip
    return True
