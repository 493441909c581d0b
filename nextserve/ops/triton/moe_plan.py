"""The plan of the grouped routed experts (ops/triton/moe_grouped.py): the (row, slot) pairs sorted by
expert id and cut into blocks of at most BLOCK_M pairs of one expert, on the device, no host reads.

# NOTE: decode: `_plan`, program p: the sorted position of pairs CHUNK*p.. (their rank by (expert id, pair
# index), counted by comparisons against every pair: no torch.sort, whose launches cost more than the
# work at n <= 320 pairs), and the block table entries CHUNK*p.. (block b -> (expert or -1, lo, hi) over
# the sorted pairs, from each expert's run [start, end) = (#ids < e, #ids <= e)); up to PLAN_SMALL pairs
# `_plan_small` does the same in one program. The number of blocks is bounded from the shapes alone,
# sum_e cdiv(c_e, BLOCK_M) <= (n + min(E, n) * (BLOCK_M - 1)) // BLOCK_M for n = M*k pairs; blocks past
# the last exit at once, so every grid is a function of (M, k, E, block sizes): capturable in a CUDA
# graph. The order and the blocks depend on the routing only, never on timing: no atomics.
# Prefill (`SORTED`): the ranking costs O(n^2) comparisons, too many at n = T*k of a chunk (20k pairs at
# T=2048), so the pairs are sorted by torch.sort (stable: ties in pair order, the same order) and each
# plan program finds every expert's run by binary search over the sorted ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start

BLOCK_M = 16
PLAN_CHUNK = 32  # pairs ranked and blocks planned per plan program
PLAN_Q = 32  # pairs compared per step of the plan's loops
PLAN_SMALL = 64  # pairs planned by one _plan_small program ([64, 64] comparisons; [E, n] work beyond)
# NOTE: the plans' [P, P] and [E_PAD, Q] temporaries live in registers: warps chosen so that ptxas (sm_90)
# spills nothing (_plan at E_PAD = 1024, i.e. 512 experts + the shared one, spilled at 4 warps). On the
# H200, _plan_small at 128 pairs took 65 us a call against 16-warp _plan's (bench_kernels.py decode_blocks).
PLAN_WARPS = 16
PLAN_SMALL_WARPS = 8
_INT_BIG = 1 << 30  # an id above every expert: masked pairs count nowhere
_SEARCH_STEPS = 31  # binary search steps of the SORTED plan: enough for n < 2**30 pairs


@triton.jit
def _lower_bound(sorted_ptr, n, v, SEARCH_STEPS: tl.constexpr):
    """For each value of v: the first index i in [0, n) with sorted[i] >= v (n if none)."""
    lo = tl.zeros_like(v)
    hi = tl.zeros_like(v) + n
    for _ in range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        s = tl.load(sorted_ptr + mid, mask=active, other=0)
        lo = tl.where(active & (s < v), mid + 1, lo)
        hi = tl.where(active & (s >= v), mid, hi)
    return lo


@triton.jit(do_not_specialize=["n", "NB_MAX"], do_not_specialize_on_alignment=["ids_ptr"])
def _plan(
    ids_ptr, order_ptr, blk_e_ptr, blk_lo_ptr, blk_hi_ptr, n, E, NB_MAX,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, Q: tl.constexpr,
    BIG: tl.constexpr, SORTED: tl.constexpr = False, SEARCH_STEPS: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """order[rank(p)] = p for pairs p = CHUNK*pid.., rank(p) = #{q : (id_q, q) < (id_p, p)} (a stable
    sort by expert id); and blocks b = CHUNK*pid.. of the plan: b -> (expert or -1, lo, hi).
    SORTED (prefill): ids are already sorted and order is not written; every program finds each
    expert's run by binary search (SEARCH_STEPS >= log2(n + 1) steps; the steps after a search ends
    load nothing), and plans its blocks only."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    if SORTED:
        e = tl.arange(0, E_PAD)
        start = _lower_bound(ids_ptr, n, e, SEARCH_STEPS)  # expert e's run in the sorted pairs
        end = _lower_bound(ids_ptr, n, e + 1, SEARCH_STEPS)
    else:
        p = pid * CHUNK + tl.arange(0, CHUNK)
        mask_p = p < n
        ep = tl.load(ids_ptr + p, mask=mask_p, other=0).to(tl.int32)
        e = tl.arange(0, E_PAD)
        rank = tl.zeros((CHUNK,), dtype=tl.int32)
        start = tl.zeros((E_PAD,), dtype=tl.int32)  # expert e's run in the sorted pairs: [start, end)
        end = tl.zeros((E_PAD,), dtype=tl.int32)
        for q0 in range(0, n, Q):
            q = q0 + tl.arange(0, Q)
            eq = tl.load(ids_ptr + q, mask=q < n, other=BIG).to(tl.int32)
            before = (eq[None, :] < ep[:, None]) | ((eq[None, :] == ep[:, None]) & (q[None, :] < p[:, None]))
            rank += tl.sum(before.to(tl.int32), axis=1)
            start += tl.sum((eq[None, :] < e[:, None]).to(tl.int32), axis=1)
            end += tl.sum((eq[None, :] <= e[:, None]).to(tl.int32), axis=1)
        tl.store(order_ptr + rank, p, mask=mask_p)
    nb = tl.where(e < E, (end - start + BLOCK_M - 1) // BLOCK_M, 0)
    cum = tl.cumsum(nb, 0)  # inclusive: expert e's blocks are [cum - nb, cum)
    b = pid * CHUNK + tl.arange(0, CHUNK)
    eb = tl.sum((cum[None, :] <= b[:, None]).to(tl.int32), axis=1)  # [CHUNK] the expert of block b
    hit = e[None, :] == eb[:, None]  # [CHUNK, E_PAD], one hit a row (none past the last block)
    first = tl.sum(tl.where(hit, cum - nb, 0), axis=1)
    lo = tl.sum(tl.where(hit, start, 0), axis=1) + (b - first) * BLOCK_M
    hi = tl.minimum(lo + BLOCK_M, tl.sum(tl.where(hit, end, 0), axis=1))
    valid = eb < E
    mask_b = b < NB_MAX
    tl.store(blk_e_ptr + b, tl.where(valid, eb, -1), mask=mask_b)
    tl.store(blk_lo_ptr + b, tl.where(valid, lo, 0), mask=mask_b)
    tl.store(blk_hi_ptr + b, tl.where(valid, hi, 0), mask=mask_b)


@triton.jit(do_not_specialize=["n", "NB_MAX"], do_not_specialize_on_alignment=["ids_ptr"])
def _plan_small(
    ids_ptr, order_ptr, blk_e_ptr, blk_lo_ptr, blk_hi_ptr, n, NB_MAX,
    BLOCK_M: tl.constexpr, P: tl.constexpr, NBP: tl.constexpr, BIG: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """`_plan` (not SORTED) for n <= P pairs in one program, by comparing the pairs with each other
    ([P, P]) instead of counting every expert's pairs ([E, n] and [CHUNK, E]): the same order and
    blocks. Pair p's expert run starts at #{q : id_q < id_p} and holds #{q : id_q == id_p} pairs; the
    run's first pair carries its cdiv(count, BLOCK_M) blocks, and the runs of smaller ids come first."""
    pdl_start(PDL)
    p = tl.arange(0, P)
    ep = tl.load(ids_ptr + p, mask=p < n, other=BIG).to(tl.int32)  # [P]
    less = ep[None, :] < ep[:, None]  # [P, P]: [p, q] = id_q < id_p
    same = ep[None, :] == ep[:, None]
    same_before = same & (p[None, :] < p[:, None])
    rank = tl.sum((less | same_before).to(tl.int32), axis=1)
    tl.store(order_ptr + rank, p, mask=p < n)
    start = tl.sum(less.to(tl.int32), axis=1)
    count = tl.sum(same.to(tl.int32), axis=1)
    head = (tl.sum(same_before.to(tl.int32), axis=1) == 0) & (p < n)
    nbk = tl.where(head, (count + BLOCK_M - 1) // BLOCK_M, 0)  # [P] blocks of p's run, on its head
    first = tl.sum(tl.where(less, nbk[None, :], 0), axis=1)  # [P] blocks of the runs before p's
    b = tl.arange(0, NBP)
    own = (first[None, :] <= b[:, None]) & (b[:, None] < first[None, :] + nbk[None, :])  # [NBP, P]
    valid = tl.sum(own.to(tl.int32), axis=1) > 0  # one owner a block, none past the last
    eb = tl.sum(tl.where(own, ep[None, :], 0), axis=1)
    lo = tl.sum(tl.where(own, start[None, :], 0), axis=1)
    lo += (b - tl.sum(tl.where(own, first[None, :], 0), axis=1)) * BLOCK_M
    hi = tl.minimum(lo + BLOCK_M, tl.sum(tl.where(own, (start + count)[None, :], 0), axis=1))
    mask_b = b < NB_MAX
    tl.store(blk_e_ptr + b, tl.where(valid, eb, -1), mask=mask_b)
    tl.store(blk_lo_ptr + b, tl.where(valid, lo, 0), mask=mask_b)
    tl.store(blk_hi_ptr + b, tl.where(valid, hi, 0), mask=mask_b)


def max_blocks(pairs: int, num_experts: int, block_m: int = BLOCK_M) -> int:
    """An upper bound on the plan's blocks from the shapes alone: sum_e cdiv(c_e, block_m) <=
    (n + active * (block_m - 1)) // block_m, with at most min(E, n) experts active."""
    return (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m


def plan(
    ids: torch.Tensor,
    num_experts: int,
    block_m: int = BLOCK_M,
    sort: bool = False,
    small: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [n]: the pairs r*k + s stably sorted by expert id, blocks [3, nb] int32: per block its
    expert (-1 past the last block), and its range [lo, hi) over the sorted pairs). Decode (sort
    False) ranks the pairs in the plan kernel (order int32); prefill (sort True) sorts them with
    torch.sort (order int64), then plans the blocks from the sorted ids. Up to PLAN_SMALL pairs
    (decode at a few rows) one `_plan_small` program does it (`small` forces either kernel: tests)."""
    n = ids.numel()
    nb_max = max_blocks(n, num_experts, block_m)
    # NOTE: rows padded to 4 entries (16 bytes), so the three rows' pointers are equally aligned at
    # every M.
    blk = torch.empty((3, triton.cdiv(max(nb_max, 1), 4) * 4), dtype=torch.int32, device=ids.device)
    consts = dict(BLOCK_M=block_m, E_PAD=triton.next_power_of_2(num_experts), CHUNK=PLAN_CHUNK, Q=PLAN_Q,
                  BIG=_INT_BIG)  # fmt: skip
    if sort:
        assert n < _INT_BIG, n
        sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
        _plan[(triton.cdiv(nb_max, PLAN_CHUNK),)](
            sorted_ids, order, blk[0], blk[1], blk[2], n, num_experts, nb_max, **consts,
            SORTED=True, SEARCH_STEPS=_SEARCH_STEPS, num_warps=PLAN_WARPS, **pdl_args(sorted_ids),
        )  # fmt: skip
    elif (n <= PLAN_SMALL) if small is None else small:
        order = torch.empty(n, dtype=torch.int32, device=ids.device)
        _plan_small[(1,)](
            ids, order, blk[0], blk[1], blk[2], n, nb_max, BLOCK_M=block_m, P=triton.next_power_of_2(n),
            NBP=triton.next_power_of_2(max(nb_max, 1)), BIG=_INT_BIG, num_warps=PLAN_SMALL_WARPS,
            **pdl_args(ids),
        )  # fmt: skip
    else:
        order = torch.empty(n, dtype=torch.int32, device=ids.device)
        _plan[(triton.cdiv(n, PLAN_CHUNK),)](
            ids, order, blk[0], blk[1], blk[2], n, num_experts, nb_max, **consts, num_warps=PLAN_WARPS,
            **pdl_args(ids),
        )  # fmt: skip
    return order, blk[:, :nb_max]
