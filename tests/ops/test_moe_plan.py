"""The grouped experts' plan (ops/triton/moe_plan.py): the pairs stably sorted by expert id, cut into
blocks of at most BLOCK_M pairs of one expert, within the shape-only bound; the one-program plan of a few
rows equals the chunked one bit for bit. In Triton's interpreter on the CPU, on the GPU under `-m gpu`."""

import pytest
import torch
from moe_cases import moe_problem
from triton_interp import DEV, small  # noqa: F401

from nextserve.ops.triton import moe_plan
from nextserve.ops.triton.moe_plan import max_blocks, plan


@small
@pytest.mark.parametrize("M,E,k", [(1, 8, 2), (5, 8, 3), (23, 6, 3), (40, 4, 2), (3, 512, 10)])
def test_plan(M, E, k) -> None:
    """order is the stable sort of the pairs by expert id; the blocks cut each expert's run of sorted
    pairs into pieces of at most BLOCK_M, in ascending expert id, then -1; their count is within the
    shape-only bound (the grid)."""
    ids = moe_problem(M, 16, E, k, 16, torch.float32, seed=M + E + k)[2]
    order, blk = plan(ids, E)
    flat = ids.reshape(-1).cpu()
    assert torch.equal(order.long().cpu(), torch.sort(flat, stable=True).indices)
    assert blk.shape == (3, max_blocks(M * k, E))
    sorted_e = flat[order.long().cpu()]
    expect = []
    for e in range(E):
        run = (sorted_e == e).nonzero().flatten().tolist()
        for j in range(0, len(run), moe_plan.BLOCK_M):
            piece = run[j : j + moe_plan.BLOCK_M]
            expect.append([e, piece[0], piece[-1] + 1])
    expect += [[-1, 0, 0]] * (blk.shape[1] - len(expect))
    assert blk.cpu().T.tolist() == expect


@small
@pytest.mark.parametrize("E,k", [(512, 10), (513, 11), (8, 3), (3, 2), (40, 1)])
def test_small_plan_equals_chunked_plan(E, k) -> None:
    """The one-program plan of a few rows gives the chunked plan's order and blocks, bit for bit, at
    every pair count up to PLAN_SMALL (experts shared by many rows, runs longer than a block), and at
    both block sizes."""
    g = torch.Generator().manual_seed(E + k)
    for M in range(1, moe_plan.PLAN_SMALL // k + 1):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
        if M % 3 == 0:  # skewed: most rows on the same experts
            ids[: M - 1] = ids[0]
        ids = ids.to(DEV)
        for block_m in (16, 4):
            a, b = plan(ids, E, block_m, small=True), plan(ids, E, block_m, small=False)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (M, block_m)


def test_max_blocks_bound_is_tight() -> None:
    assert max_blocks(10, 512) == 10  # M = 1: every pair its own block
    assert max_blocks(320, 512) == 320
    assert max_blocks(330, 20) == (330 + 20 * 15) // 16
    assert max_blocks(1, 8) == 1
