"""Batched QSA decode over the paged cache (index_scores, select_decode_tokens, paged_sparse_attention):
the CPU references against select_tokens / sparse_attention, the Triton kernels against the references
(through Triton's interpreter on CPU, float32), and row invariance of the kernels (C1)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from qsa_reference import select_tokens

from nextserve.ops.attention import (
    index_scores,
    paged_sparse_attention,
    select_decode_tokens,
    sparse_attention,
)
from nextserve.ops.triton.qsa_decode import triton_index_scores, triton_paged_sparse_attention

TINY = dict(nq=4, nkv=2, d=32, ni=2, di=32, c=4, topk=2, page=8)
REAL = dict(nq=24, nkv=2, d=256, ni=4, di=128, c=4, topk=512, page=64)


@dataclass
class Paged:
    """B decode rows, row b at position lengths[b] - 1: contiguous context and its paged layout."""

    q: torch.Tensor  # [B, Nq, D]
    q_idx: torch.Tensor  # [B, Ni, di]
    k: list[torch.Tensor]  # contiguous [len, Nkv, D] per row
    v: list[torch.Tensor]
    keys: list[torch.Tensor]  # contiguous [n_blocks, di] per row
    k_plane: torch.Tensor  # [pages, P, Nkv, D]
    v_plane: torch.Tensor
    key_plane: torch.Tensor  # [pages, P // c, di]
    block_table: torch.Tensor  # [B, maxP] int32
    positions: torch.Tensor  # [B] int64
    n_blocks: torch.Tensor  # [B] int64
    max_blocks: int


def make_paged(lengths, s, dtype=torch.float32, device="cpu", seed=0, spare_pages=3) -> Paged:
    g = torch.Generator().manual_seed(seed)
    P, c = s["page"], s["c"]
    bpp = P // c

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    n_pages = [-(-n // P) for n in lengths]
    max_p = max(1, *n_pages)
    total = sum(n_pages) + spare_pages
    perm = torch.randperm(total, generator=g)
    # garbage everywhere: slots no row owns must never be read
    k_plane, v_plane = rnd(total, P, s["nkv"], s["d"]), rnd(total, P, s["nkv"], s["d"])
    key_plane = rnd(total, bpp, s["di"])
    table = torch.randint(0, total, (len(lengths), max_p), generator=g, dtype=torch.int32)  # padding
    ks, vs, keys = [], [], []
    first = 0
    for b, n in enumerate(lengths):
        pages = perm[first : first + n_pages[b]]
        first += n_pages[b]
        table[b, : n_pages[b]] = pages.to(torch.int32)
        pages = pages.to(device)
        k, v, kb = rnd(n, s["nkv"], s["d"]), rnd(n, s["nkv"], s["d"]), rnd(n // c, s["di"])
        pos = torch.arange(n, device=device)
        k_plane[pages[pos // P], pos % P] = k
        v_plane[pages[pos // P], pos % P] = v
        blk = torch.arange(n // c, device=device)
        key_plane[pages[blk // bpp], blk % bpp] = kb
        ks.append(k), vs.append(v), keys.append(kb)
    B = len(lengths)
    return Paged(
        q=rnd(B, s["nq"], s["d"]),
        q_idx=rnd(B, s["ni"], s["di"]),
        k=ks,
        v=vs,
        keys=keys,
        k_plane=k_plane,
        v_plane=v_plane,
        key_plane=key_plane,
        block_table=table.to(device),
        positions=torch.tensor([n - 1 for n in lengths], device=device),
        n_blocks=torch.tensor([n // c for n in lengths], device=device),
        max_blocks=max_p * bpp,
    )


def direct_scores(p: Paged, row: int) -> torch.Tensor:
    """select_tokens' scores of row `row` over its contiguous block keys."""
    s = torch.matmul(p.q_idx[row].float(), p.keys[row].float().t())
    return torch.relu(s.t()).sum(dim=-1) / math.sqrt(p.q_idx.shape[-1])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def valid(row: torch.Tensor) -> torch.Tensor:
    return row[row >= 0].long()


def valid_first(tokens: torch.Tensor) -> bool:
    """Each row: valid entries first, strictly ascending, then -1 only."""
    for row in tokens:
        nv = int((row >= 0).sum())
        if not ((row[nv:] == -1).all() and (row[:nv].diff() > 0).all()):
            return False
    return True


# ---- index_scores -------------------------------------------------------------------------------------
LENGTHS = [1, 3, 4, 9, 31, 33, 64, 70]


def test_index_scores_reference_and_kernel() -> None:
    p = make_paged(LENGTHS, TINY)
    ref = index_scores(p.q_idx, p.key_plane, p.block_table, p.n_blocks, p.max_blocks)
    ker = triton_index_scores(p.q_idx, p.key_plane, p.block_table, p.n_blocks, p.max_blocks)
    assert ref.shape == ker.shape == (len(LENGTHS), p.max_blocks) and ker.dtype == torch.float32
    for b in range(len(LENGTHS)):
        nb = int(p.n_blocks[b])
        assert torch.equal(ref[b, :nb], direct_scores(p, b))
        assert torch.isneginf(ref[b, nb:]).all() and torch.isneginf(ker[b, nb:]).all()
        if nb:
            torch.testing.assert_close(ker[b, :nb], ref[b, :nb], rtol=1e-5, atol=1e-6)


def test_index_scores_kernel_rows_are_invariant() -> None:
    p = make_paged(LENGTHS, TINY, seed=1)
    args = (p.key_plane, p.block_table, p.n_blocks, p.max_blocks)
    full = triton_index_scores(p.q_idx, *args, block_j=16)
    for b in range(len(LENGTHS)):
        alone = triton_index_scores(p.q_idx[b : b + 1], p.key_plane, p.block_table[b : b + 1],
                                    p.n_blocks[b : b + 1], p.max_blocks, block_j=16)  # fmt: skip
        assert torch.equal(alone[0], full[b]), b
    sub = triton_index_scores(
        p.q_idx[2:5], p.key_plane, p.block_table[2:5], p.n_blocks[2:5], p.max_blocks, 16
    )
    assert torch.equal(sub, full[2:5])


# ---- select_decode_tokens -----------------------------------------------------------------------------
@pytest.mark.parametrize("topk", [2, 5])
def test_select_decode_tokens_equals_select_tokens(topk: int) -> None:
    lengths = list(range(1, 50))  # n_blocks 0 .. 12: below, at and above topk, every tail length
    p = make_paged(lengths, TINY, seed=2)
    # NOTE: relu makes exact ties (at 0) common with random signs, and topk breaks ties its own way;
    # positive queries and keys make every score positive and distinct.
    for t in (p.q_idx, p.key_plane, *p.keys):
        t.abs_()
    c = TINY["c"]
    scores = index_scores(p.q_idx, p.key_plane, p.block_table, p.n_blocks, p.max_blocks)
    for b in range(len(lengths)):
        nb = int(p.n_blocks[b])
        assert scores[b, :nb].unique().numel() == nb
    tokens = select_decode_tokens(scores, p.n_blocks, p.positions, c, topk)
    assert tokens.shape == (len(lengths), topk * c + c) and tokens.dtype == torch.int32
    assert valid_first(tokens)
    for b, n in enumerate(lengths):
        (want,) = select_tokens(p.q_idx[b : b + 1], p.keys[b], [n - 1], c, topk)
        row = tokens[b]
        nv = want.shape[0]
        assert torch.equal(row[:nv].long(), want), (n, row, want)
        assert (row[nv:] == -1).all()


def test_prefill_and_decode_selection_agree_on_ties() -> None:
    """Random signs make relu scores of exactly 0 common; `select_tokens` (the prefill chunk path
    before it used these ops, and the oracle's rule) and `select_decode_tokens` must still pick the
    same blocks: ties go to the lower block in both (a mismatch here once made decode rows differ
    from the chunk path)."""
    lengths = list(range(1, 50))
    p = make_paged(lengths, TINY, seed=3)
    c, topk = TINY["c"], 2
    scores = index_scores(p.q_idx, p.key_plane, p.block_table, p.n_blocks, p.max_blocks)
    tied = sum(int((scores[b, : int(p.n_blocks[b])] == 0).sum() > 1) for b in range(len(lengths)))
    assert tied > 5  # the case this test is for actually occurs
    tokens = select_decode_tokens(scores, p.n_blocks, p.positions, c, topk)
    for b, n in enumerate(lengths):
        nb = int(p.n_blocks[b])
        # the rule, written out: highest score first, the lower block among equals
        blocks = sorted(sorted(range(nb), key=lambda j: (-float(scores[b, j]), j))[:topk])
        want = [j * c + i for j in blocks for i in range(c)] + list(range(nb * c, n))
        (chunk_path,) = select_tokens(p.q_idx[b : b + 1], p.keys[b], [n - 1], c, topk)
        assert chunk_path.tolist() == want, n
        assert tokens[b][: len(want)].tolist() == want, n


def test_select_decode_tokens_narrow_scores_and_ties() -> None:
    c, topk = 4, 3
    # max_blocks < block_topk: every valid block, padded
    scores = torch.tensor([[0.5, 2.0], [1.0, float("-inf")]])
    n_blocks, positions = torch.tensor([2, 1]), torch.tensor([9, 5])
    tokens = select_decode_tokens(scores, n_blocks, positions, c, topk)
    assert tokens.shape == (2, topk * c + c)
    assert valid(tokens[0]).tolist() == list(range(10))
    assert valid(tokens[1]).tolist() == list(range(6))
    assert valid_first(tokens)
    # all-equal scores pick the lowest blocks
    n_blocks = torch.tensor([10, 7])
    zeros = torch.zeros(2, 12)
    zeros[1, 7:] = float("-inf")
    tokens = select_decode_tokens(zeros, n_blocks, n_blocks * c + torch.tensor([2, 0]), c, topk)
    assert valid(tokens[0]).tolist() == list(range(12)) + [40, 41, 42]
    assert valid(tokens[1]).tolist() == list(range(12)) + [28]
    # a tie at the cut: the lower block wins
    s = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0]])
    tokens = select_decode_tokens(s, torch.tensor([6]), torch.tensor([23]), c, topk)
    assert valid(tokens[0]).tolist() == [*range(4, 8), *range(8, 12), *range(12, 16)]


# ---- paged_sparse_attention ---------------------------------------------------------------------------
def _tokens(p: Paged, topk: int) -> torch.Tensor:
    scores = index_scores(p.q_idx, p.key_plane, p.block_table, p.n_blocks, p.max_blocks)
    return select_decode_tokens(scores, p.n_blocks, p.positions, TINY["c"], topk)


@pytest.mark.parametrize("topk", [2, 16])
def test_paged_attention_reference_is_sparse_attention(topk: int) -> None:
    lengths = [1, 5, 8, 17, 40, 77, 90]
    p = make_paged(lengths, TINY, seed=3)
    sel = [
        select_tokens(p.q_idx[b : b + 1], p.keys[b], [n - 1], TINY["c"], topk)[0]
        for b, n in enumerate(lengths)
    ]
    tokens = torch.full((len(lengths), topk * TINY["c"] + TINY["c"]), -1, dtype=torch.int32)
    for b, s in enumerate(sel):
        tokens[b, : s.shape[0]] = s.to(torch.int32)
    scaling = TINY["d"] ** -0.5
    out = paged_sparse_attention(p.q, p.k_plane, p.v_plane, p.block_table, tokens, scaling)
    for b in range(len(lengths)):
        want = sparse_attention(p.q[b : b + 1], p.k[b], p.v[b], [sel[b]], scaling)[0]
        assert torch.equal(out[b], want), b


# tile, num_splits: one tile; several tiles in one split; several splits of several tiles
KERNEL_TILINGS = [(32, 32), (16, 1), (16, 4)]


@pytest.mark.parametrize("tiling", KERNEL_TILINGS)
@pytest.mark.parametrize("topk", [2, 16])
def test_paged_attention_kernel_vs_reference(topk: int, tiling: tuple[int, int]) -> None:
    lengths = [1, 5, 8, 17, 40, 77, 90]
    p = make_paged(lengths, TINY, seed=4)
    tokens = _tokens(p, topk)
    scaling = TINY["d"] ** -0.5
    args = (p.q, p.k_plane, p.v_plane, p.block_table, tokens, scaling)
    ref = paged_sparse_attention(*args)
    ker = triton_paged_sparse_attention(*args, tile=tiling[0], num_splits=tiling[1])
    assert ker.dtype == p.q.dtype and ker.shape == ref.shape
    for b in range(len(lengths)):
        assert rel(ker[b], ref[b]) < 1e-5, b


def test_paged_attention_kernel_scattered_padding() -> None:
    """-1 anywhere in the list (not only at the end) is skipped; a row of -1 only gives zeros."""
    p = make_paged([40, 33, 20], TINY, seed=5)
    g = torch.Generator().manual_seed(5)
    tokens = torch.full((3, 48), -1, dtype=torch.int32)
    tokens[0, ::3] = torch.randperm(40, generator=g)[:16].to(torch.int32)  # unordered, gaps
    tokens[1, 17:30] = torch.arange(13, dtype=torch.int32) * 2
    scaling = TINY["d"] ** -0.5
    args = (p.q, p.k_plane, p.v_plane, p.block_table, tokens, scaling)
    ref = paged_sparse_attention(*args)
    ker = triton_paged_sparse_attention(*args, tile=16, num_splits=2)
    for b in range(2):
        assert rel(ker[b], ref[b]) < 1e-5, b
    assert torch.equal(ker[2], torch.zeros_like(ker[2]))


@pytest.mark.parametrize("tiling", KERNEL_TILINGS)
def test_paged_attention_kernel_rows_are_invariant(tiling: tuple[int, int]) -> None:
    lengths = [3, 90, 41, 64, 12, 77]
    p = make_paged(lengths, TINY, seed=6)
    tokens = _tokens(p, 16)
    scaling = TINY["d"] ** -0.5

    def run(sl: slice) -> torch.Tensor:
        return triton_paged_sparse_attention(p.q[sl], p.k_plane, p.v_plane, p.block_table[sl], tokens[sl],
                                             scaling, tile=tiling[0], num_splits=tiling[1])  # fmt: skip

    full = run(slice(None))
    for b in range(len(lengths)):
        assert torch.equal(run(slice(b, b + 1))[0], full[b]), b
    assert torch.equal(run(slice(1, 4)), full[1:4])


# ---- CUDA, real sizes, bf16 ---------------------------------------------------------------------------
def gpu(fn):
    no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.gpu(no_cuda(fn))


GPU_LENGTHS = [1, 5, 2047, 2048, 2049, 2051, 4099, 20000, 32768, 300]


def _cpu(p: Paged, b: int) -> Paged:
    """Row b alone with only its own pages, on the CPU (for the references)."""
    P, c = REAL["page"], REAL["c"]
    n = int(p.positions[b]) + 1
    pages = p.block_table[b, : -(-n // P)].long()
    return Paged(
        q=p.q[b : b + 1].cpu(), q_idx=p.q_idx[b : b + 1].cpu(), k=[], v=[], keys=[],
        k_plane=p.k_plane[pages].cpu(), v_plane=p.v_plane[pages].cpu(), key_plane=p.key_plane[pages].cpu(),
        block_table=torch.arange(pages.shape[0], dtype=torch.int32)[None, :],
        positions=p.positions[b : b + 1].cpu(), n_blocks=p.n_blocks[b : b + 1].cpu(), max_blocks=n // c,
    )  # fmt: skip


@gpu
def test_cuda_real_sizes_match_reference() -> None:
    p = make_paged(GPU_LENGTHS, REAL, dtype=torch.bfloat16, device="cuda", seed=7)
    c, topk, scaling = REAL["c"], REAL["topk"], REAL["d"] ** -0.5
    scores = index_scores(p.q_idx, p.key_plane, p.block_table, p.n_blocks, p.max_blocks)
    tokens = select_decode_tokens(scores, p.n_blocks, p.positions, c, topk)
    out = paged_sparse_attention(p.q, p.k_plane, p.v_plane, p.block_table, tokens, scaling)
    assert out.dtype == torch.bfloat16
    cpu_tokens = select_decode_tokens(scores.cpu(), p.n_blocks.cpu(), p.positions.cpu(), c, topk)
    assert torch.equal(cpu_tokens, tokens.cpu())
    for b in range(len(GPU_LENGTHS)):
        r = _cpu(p, b)
        ref_s = index_scores(r.q_idx, r.key_plane, r.block_table, r.n_blocks, r.max_blocks)[0]
        nb = int(r.n_blocks[0])
        if nb:
            torch.testing.assert_close(scores[b, :nb].cpu(), ref_s, rtol=1e-4, atol=1e-4)
        assert torch.isneginf(scores[b, nb:]).all()
        ref_o = paged_sparse_attention(
            r.q, r.k_plane, r.v_plane, r.block_table, tokens[b : b + 1].cpu(), scaling
        )
        assert rel(out[b].cpu(), ref_o[0]) < 2e-2, b


@gpu
def test_cuda_rows_are_invariant_and_graph_capturable() -> None:
    p = make_paged(GPU_LENGTHS, REAL, dtype=torch.bfloat16, device="cuda", seed=8)
    c, topk, scaling = REAL["c"], REAL["topk"], REAL["d"] ** -0.5

    def step(q, q_idx, table, n_blocks, positions):
        scores = index_scores(q_idx, p.key_plane, table, n_blocks, p.max_blocks)
        tokens = select_decode_tokens(scores, n_blocks, positions, c, topk)
        return scores, tokens, paged_sparse_attention(q, p.k_plane, p.v_plane, table, tokens, scaling)

    def rows(sl: slice):
        return step(p.q[sl], p.q_idx[sl], p.block_table[sl], p.n_blocks[sl], p.positions[sl])

    full = rows(slice(None))
    for b in range(len(GPU_LENGTHS)):
        alone = rows(slice(b, b + 1))
        for x, y in zip(alone, full, strict=True):
            assert torch.equal(x[0], y[b]), b
    sub = rows(slice(3, 8))
    for x, y in zip(sub, full, strict=True):
        assert torch.equal(x, y[3:8])

    static = [t.clone() for t in (p.q, p.q_idx, p.block_table, p.n_blocks, p.positions)]
    rows(slice(None))  # warm up (compiles) before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*static)
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(captured, full, strict=True):
        assert torch.equal(x, y)
    # new inputs in the same buffers: the replay follows them
    for dst, src in zip(static, (p.q, p.q_idx, p.block_table, p.n_blocks, p.positions), strict=True):
        dst.copy_(src.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(captured, full, strict=True):
        assert torch.equal(x, y.flip(0))
