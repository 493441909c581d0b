"""The block selection kernel (ops/triton/qsa_select.py, in Triton's interpreter without a GPU) against
`select_decode_tokens`'s torch reference, torch.equal on every row: ties (many exact zeros, equal values
across the cut), negative and special scores, every n_blocks around block_topk, every tail length,
narrow scores (M < block_topk), B = 0, and row invariance (C1); on CUDA at the real sizes (`-m gpu`)."""

from __future__ import annotations

import pytest
import torch
from triton_interp import DEV, needs_cuda, small

from nextserve.ops.attention import _select_decode_tokens_reference, select_decode_tokens
from nextserve.ops.triton import qsa_select
from nextserve.ops.triton.qsa_select import SelectTiles, triton_select_decode_tokens

gpu = pytest.mark.gpu
C, TOPK = 4, 512  # the real compress ratio and block_topk


def make_rows(
    n_blocks: list[int], M: int, seed: int, levels: int | None = None, relu: bool = False, tails=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores [B, M] as `index_scores` leaves them (-inf from n_blocks[b] on); `levels` rounds them to
    multiples of 1/levels (many exact ties), `relu` makes exact zeros common. positions: the decode
    row's own ((pos + 1) // c == n_blocks) unless `tails` gives pos - n_blocks*c per row (any int)."""
    g = torch.Generator().manual_seed(seed)
    B = len(n_blocks)
    scores = torch.randn(B, M, generator=g) * 3
    if levels is not None:
        scores = (scores * levels).round() / levels
    if relu:
        scores = scores.relu()
    nb = torch.tensor(n_blocks, dtype=torch.int64)
    scores[torch.arange(M)[None, :] >= nb[:, None]] = float("-inf")
    tail = torch.randint(0, C, (B,), generator=g) if tails is None else torch.tensor(tails)
    return scores, nb, nb * C + tail


def check(scores, nb, pos, c: int, topk: int, tiles: SelectTiles | None = None) -> torch.Tensor:
    want = _select_decode_tokens_reference(scores, nb, pos, c, topk)
    got = triton_select_decode_tokens(scores.to(DEV), nb.to(DEV), pos.to(DEV), c, topk, tiles).cpu()
    assert got.shape == want.shape and got.dtype == torch.int32
    for b in range(want.shape[0]):
        assert torch.equal(got[b], want[b]), (b, int(nb[b]), int(pos[b]), got[b], want[b])
    return got


# tiles far below the defaults: rows of a few blocks cross large and small tiles' edges, and the
# radix's last digit overlaps bits fixed before it (7 bits: 5 passes, the last one 4 bits wide)
TINY_TILES = SelectTiles(radix_bits=7, tile_r=16, tile_s=8, tile_small=4, num_warps=1)


@small
@pytest.mark.parametrize("topk", [2, 5, 8])
def test_tiny_widths_ties_and_tails(topk: int) -> None:
    """M from 1 to 40 (below, at and above topk, and at the tiny tiles' edges), n_blocks 0..M, tails of 0..c
    tokens, ties; the default tiles and tiny ones."""
    # NOTE: the widths around topk and each tiny tile's edge (4, 8, 16) and the ends; the interpreter runs
    # a call in about 0.1 s, so not every width (a third of the CPU suite's longest test)
    edges = {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 40}
    for M in sorted(edges | {topk - 1, topk, topk + 1, topk + 2} - {0}):
        n_blocks = [0, min(M, topk), min(M, topk + 1), M, M // 2, M - 1]
        for i, (levels, relu) in enumerate([(None, False), (1, True), (2, False)]):
            tails = [-2, 0, 1, 3, 4, 9] if i == 2 else None  # arbitrary tails: clamped to 0..c tokens
            rows = make_rows(n_blocks, M, seed=M * 10 + i, levels=levels, relu=relu, tails=tails)
            check(*rows, C, topk, TINY_TILES if (M + i) % 2 else None)


@small
def test_ties_at_the_cut_and_special_values() -> None:
    c, topk = 4, 3
    rows = [
        [1.0, 3.0, 2.0, 2.0, 2.0, 0.0, 2.0, 2.0],  # equal values straddle the cut
        [0.0] * 8,  # all tied: the lowest blocks
        [-0.0, 0.0, -0.0, 0.0, -1.0, -0.0, 5e-45, -5e-45],  # -0.0 equals 0.0; denormals order
        [-3.0, -1.0, -2.0, -1.0, -5.0, -1.0, -7.0, -1.0],  # negative only
        [float("-inf"), -1e38, 3e38, float("-inf"), 0.0, float("-inf"), 1.0, -0.0],  # -inf inside
        [float("nan"), 1.0, float("inf"), -float("nan"), 2.0, 0.0, 3.0, 4.0],  # the sort puts NaN first
    ]
    scores = torch.tensor(rows)
    nb = torch.full((len(rows),), 8)
    check(scores, nb, nb * c + 2, c, topk)
    # n_blocks out of range: past M (all M columns are candidates), negative (no block, tail only)
    check(scores[:2], torch.tensor([11, -1]), torch.tensor([46, 1]), c, topk)
    check(scores[:2], torch.tensor([11, -1]), torch.tensor([46, 1]), c, 8)


@small
def test_batch_of_none() -> None:
    scores, nb, pos = make_rows([3], 16, seed=0)
    out = triton_select_decode_tokens(scores[:0].to(DEV), nb[:0].to(DEV), pos[:0].to(DEV), C, 5)
    assert out.shape == (0, 5 * C + C) and out.dtype == torch.int32


@small
@pytest.mark.parametrize("M", [2048, 8192])
def test_real_sizes(M: int) -> None:
    """block_topk 512 at both widths: all valid (100, 512), one too many (513), many (3000 / M)."""
    n_blocks = [100, 512, 513, min(3000, M), M]
    for seed, (levels, relu) in enumerate([(None, False), (2, True), (1000, True)]):
        check(*make_rows(n_blocks, M, seed=seed, levels=levels, relu=relu), C, TOPK)


@small
@pytest.mark.parametrize("prefill_rows", [qsa_select.PREFILL_ROWS, 4])
def test_rows_are_invariant(prefill_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row's tokens are the same alone as in a batch of other rows (C1), also where the batch's row count
    picks the prefill configuration and a row alone the decode one (prefill_rows 4)."""
    monkeypatch.setattr(qsa_select, "PREFILL_ROWS", prefill_rows)
    n_blocks = [0, 1, 7, 40, 600, 513, 2047, 100]
    scores, nb, pos = make_rows(n_blocks, 2048, seed=5, levels=4, relu=True)
    args = (scores.to(DEV), nb.to(DEV), pos.to(DEV))
    full = triton_select_decode_tokens(*args, C, TOPK)
    for b in range(len(n_blocks)):
        alone = triton_select_decode_tokens(*(t[b : b + 1] for t in args), C, TOPK)
        assert torch.equal(alone[0], full[b]), b
    assert torch.equal(triton_select_decode_tokens(*(t[2:6] for t in args), C, TOPK), full[2:6])


@small
def test_prefill_configuration_against_the_reference() -> None:
    """PREFILL_TILES (a row count at and past PREFILL_ROWS picks it, one below does not) gives the reference's
    tokens: rows across its small tiles' edges and its write tile, ties, exact zeros."""
    assert qsa_select.select_tiles(qsa_select.PREFILL_ROWS - 1) == qsa_select.DECODE_TILES
    assert qsa_select.select_tiles(qsa_select.PREFILL_ROWS) == qsa_select.PREFILL_TILES
    assert qsa_select.select_tiles(qsa_select.PREFILL_ROWS + 1) == qsa_select.PREFILL_TILES
    n_blocks = [0, 511, 512, 513, 1023, 1024, 1025, 1537, 2048]
    for seed, (levels, relu) in enumerate([(None, False), (2, True)]):
        rows = make_rows(n_blocks, 2048, seed=seed, levels=levels, relu=relu)
        check(*rows, C, TOPK, qsa_select.PREFILL_TILES)


@pytest.mark.parametrize(
    "bad",
    [
        dict(radix_bits=0),
        dict(radix_bits=17),
        dict(tile_r=0),
        dict(tile_r=3000),
        dict(tile_s=2**15),
        dict(tile_small=2**15),
        dict(num_warps=6),
    ],
)
def test_select_tiles_refuses_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        SelectTiles(**bad)


def test_cpu_path_is_the_reference() -> None:
    scores, nb, pos = make_rows([0, 3, 9], 12, seed=1, levels=1, relu=True)
    assert torch.equal(
        select_decode_tokens(scores, nb, pos, C, 4), _select_decode_tokens_reference(scores, nb, pos, C, 4)
    )


@gpu
@needs_cuda
@pytest.mark.parametrize("M", [8192, 65536])
def test_cuda_real_sizes(M: int) -> None:
    """On CUDA through `select_decode_tokens` (the kernel) against the CPU reference, torch.equal, and
    the same tokens after replaying a CUDA graph on new scores."""
    n_blocks = [0, 5, 100, 511, 512, 513, 3000, 8191, M - 1, M]
    for seed, (levels, relu) in enumerate([(None, False), (2, True), (1000, True), (None, True)]):
        scores, nb, pos = make_rows(n_blocks, M, seed=seed, levels=levels, relu=relu)
        want = _select_decode_tokens_reference(scores, nb, pos, C, TOPK)
        got = select_decode_tokens(scores.cuda(), nb.cuda(), pos.cuda(), C, TOPK)
        assert torch.equal(got.cpu(), want), seed
    # a prefill chunk's row count (the prefill configuration): rows of every n_blocks up to M
    chunk = torch.linspace(0, M, qsa_select.PREFILL_ROWS).long().tolist()
    scores, nb, pos = make_rows(chunk, M, seed=4, levels=1000, relu=True)
    got = select_decode_tokens(scores.cuda(), nb.cuda(), pos.cuda(), C, TOPK)
    assert torch.equal(got.cpu(), _select_decode_tokens_reference(scores, nb, pos, C, TOPK))
    static = [t.cuda() for t in make_rows(n_blocks, M, seed=10)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = select_decode_tokens(*static, C, TOPK)
    scores, nb, pos = make_rows(n_blocks, M, seed=11, levels=3, relu=True)
    for s, t in zip(static, (scores, nb, pos), strict=True):
        s.copy_(t)
    graph.replay()
    assert torch.equal(out.cpu(), _select_decode_tokens_reference(scores, nb, pos, C, TOPK))


@gpu
@needs_cuda
@pytest.mark.parametrize("rows", [8, qsa_select.PREFILL_ROWS])
def test_cuda_one_binary_at_any_positions_offset(rows: int) -> None:
    """positions and n_blocks as views at an odd int64 offset (a chunk after an odd-length chunk in one
    forward: 8 bytes off a 16-byte boundary) give the same tokens and run the binary compiled for aligned
    ones: nothing compiles at first use (either configuration)."""
    kernel = qsa_select._select_kernel

    def binaries() -> int:
        return sum(len(c[0]) for c in kernel.device_caches.values())

    n_blocks = torch.linspace(0, 4096, rows).long().tolist()
    scores, nb, pos = (t.cuda() for t in make_rows(n_blocks, 4096, seed=6, levels=1000, relu=True))
    want = select_decode_tokens(scores, nb, pos, C, TOPK)
    before = binaries()
    nb_off, pos_off = torch.cat([nb[:1], nb])[1:], torch.cat([pos[:1], pos])[1:]
    assert nb_off.data_ptr() % 16 == 8 and pos_off.data_ptr() % 16 == 8
    assert torch.equal(select_decode_tokens(scores, nb_off, pos_off, C, TOPK), want)
    assert binaries() == before
