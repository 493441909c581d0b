"""The indexer's open block of decode rows (ops/triton/qsa_tail.py, in Triton's interpreter without a GPU):
the tail plane and the block mean equal the torch reference's bit for bit (ops/attention.indexer_open_block),
at every place in a block, with padding rows sharing the scratch slot; the rotary table's rows equal the
computed cos and sin on the GPU."""

import pytest
import torch
from triton_interp import DEV, needs_cuda, small

from nextserve.ops.attention import _indexer_open_block_reference, indexer_open_block
from nextserve.ops.rope import cos_sin, inv_freq
from nextserve.ops.triton.qsa_tail import triton_indexer_open_block

gpu = pytest.mark.gpu


def _case(B: int, S: int, c: int, di: int, dtype: torch.dtype, seed: int, device=DEV):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(B, di + 8, generator=g).to(dtype)[:, 8:]  # a column slice, as the projection gives
    tail = torch.randn(S, c - 1, di, generator=g).to(dtype)
    slots = torch.randperm(S - 1, generator=g)[:B]
    positions = torch.randint(0, 5000, (B,), generator=g)
    positions[: min(B, c)] = torch.arange(min(B, c)) + 4 * c  # every place in a block
    return raw.to(device), tail.to(device), slots.to(device), positions.to(device)


def _check(B, S, c, di, dtype, device, seed=0):
    raw, tail, slots, positions = _case(B, S, c, di, dtype, seed, device)
    tail_ref = tail.cpu().clone()
    ref = indexer_open_block(raw.cpu(), tail_ref, slots.cpu(), positions.cpu(), c)
    got = triton_indexer_open_block(raw, tail, slots, positions, c)
    assert torch.equal(got[1].cpu(), ref[1])
    assert torch.equal(got[0].cpu(), ref[0]), (got[0].cpu() - ref[0]).abs().max()
    assert torch.equal(tail.cpu(), tail_ref)


@small
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("c,di", [(4, 32), (4, 20), (2, 16)])
def test_matches_reference(dtype: torch.dtype, c: int, di: int) -> None:
    _check(9, 12, c, di, dtype, DEV)


@small
def test_padding_rows_share_the_scratch_slot() -> None:
    """Rows on one scratch slot at position 0 (a graph's padding) write equal values; real rows are exact."""
    raw, tail, slots, positions = _case(6, 12, 4, 32, torch.float32, 3)
    raw[3:] = raw[3]
    slots[3:], positions[3:] = 11, 0
    tail_ref = tail.clone()
    ref = indexer_open_block(raw.clone(), tail_ref, slots, positions, 4)
    got = triton_indexer_open_block(raw, tail, slots, positions, 4)
    assert torch.equal(got[0][:3], ref[0][:3]) and torch.equal(tail[:11], tail_ref[:11])


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_reference(dtype: torch.dtype) -> None:
    """The real indexer widths (c = 4, di = 128): the kernel against the torch ops on the GPU, bit for bit."""
    for B, seed in [(1, 1), (7, 2), (64, 3)]:
        raw, tail, slots, positions = _case(B, 80, 4, 128, dtype, seed, "cuda")
        tail_ref = tail.clone()
        ref = _indexer_open_block_reference(raw, tail_ref, slots, positions, 4)  # torch ops, on the GPU
        got = triton_indexer_open_block(raw, tail, slots, positions, 4)
        assert torch.equal(got[1], ref[1]) and torch.equal(tail, tail_ref)
        assert torch.equal(got[0], ref[0]), (B, (got[0].float() - ref[0].float()).abs().max())


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_rotary_table_rows_are_computed_cos_sin(dtype: torch.dtype) -> None:
    """FlashNext.prepare's table: a row equals cos_sin at that position, whatever positions beside it."""
    inv_f = inv_freq(64, 1e7).cuda()
    table = torch.cat(cos_sin(torch.arange(300000, device="cuda"), inv_f, dtype), dim=-1)
    g = torch.Generator().manual_seed(0)
    for B in (1, 3, 32, 257):
        pos = torch.randint(0, 300000, (B,), generator=g).cuda()
        assert torch.equal(table.index_select(0, pos), torch.cat(cos_sin(pos, inv_f, dtype), dim=-1)), B
