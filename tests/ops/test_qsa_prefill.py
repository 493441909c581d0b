"""QSA prefill over the paged cache (prefill_index_scores, prefill_sparse_attention): the CPU references
against the per-row rule, the Triton kernels against the references (Triton's interpreter on the CPU,
float32; CUDA at real sizes in bfloat16), and a chunk's result a function of the chunk alone (C1)."""

from __future__ import annotations

import math

import pytest
import torch
from triton_interp import needs_cuda

from nextserve.ops.attention import (
    _index_scores_reference,
    paged_sparse_attention,
    prefill_index_scores,
    prefill_sparse_attention,
    select_decode_tokens,
)
from nextserve.ops.triton.qsa_decode import triton_paged_sparse_attention
from nextserve.ops.triton.qsa_prefill import BLOCK_J, prefill_score_width, triton_prefill_index_scores

TINY = dict(nq=4, nkv=2, d=32, ni=2, di=32, c=4, topk=2, page=8)
REAL = dict(nq=24, nkv=2, d=256, ni=4, di=128, c=4, topk=512, page=64)


def make_sequence(length: int, s: dict, dtype=torch.float32, device="cpu", seed=0, spare=5):
    """One sequence's paged K, V and block keys (length tokens) among garbage pages it does not own."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    P, c = s["page"], s["c"]
    n_pages = -(-length // P)
    total = n_pages + spare
    pages = torch.randperm(total, generator=g)[:n_pages]
    planes = rnd(total, P, s["nkv"], s["d"]), rnd(total, P, s["nkv"], s["d"]), rnd(total, P // c, s["di"])
    return (*planes, pages.to(torch.int32).to(device))


def chunk_queries(T: int, s: dict, dtype=torch.float32, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    q_idx = torch.randn(T, s["ni"], s["di"], generator=g).to(dtype).to(device)
    q = torch.randn(T, s["nq"], s["d"], generator=g).to(dtype).to(device)
    return q_idx, q


def per_row_scores(q_idx, key_plane, table, start: int, c: int) -> list[torch.Tensor]:
    """Each row's scores over its complete blocks, from its contiguous block keys (the rule)."""
    bpp = key_plane.shape[1]
    out = []
    for i in range(q_idx.shape[0]):
        nb = (start + i + 1) // c
        blk = torch.arange(nb)
        keys = key_plane[table.long()[blk // bpp], blk % bpp].float()  # [nb, di]
        s = torch.relu(torch.matmul(q_idx[i].float(), keys.t()).t()).sum(-1) / math.sqrt(q_idx.shape[-1])
        out.append(s)
    return out


CHUNKS = [(0, 1), (0, 9), (3, 70), (37, 64), (61, 130), (128, 64)]  # (start, T)


@pytest.mark.parametrize("start,T", CHUNKS)
def test_prefill_index_scores_reference_is_the_rule(start: int, T: int) -> None:
    _, _, key_plane, table = make_sequence(start + T, TINY)
    q_idx, _ = chunk_queries(T, TINY)
    scores, n_blocks = prefill_index_scores(q_idx, key_plane, table, start, TINY["c"])
    assert scores.shape == (T, max(1, (start + T) // TINY["c"]))
    assert torch.equal(n_blocks, torch.arange(start + 1, start + T + 1) // TINY["c"])
    for i, want in enumerate(per_row_scores(q_idx, key_plane, table, start, TINY["c"])):
        nb = want.shape[0]
        assert torch.equal(scores[i, :nb], want), i
        assert torch.isneginf(scores[i, nb:]).all(), i


@pytest.mark.parametrize("start,T", CHUNKS)
def test_prefill_index_scores_kernel_vs_reference(start: int, T: int) -> None:
    c = TINY["c"]
    _, _, key_plane, table = make_sequence(start + T, TINY, seed=start)
    q_idx, _ = chunk_queries(T, TINY, seed=T)
    ker = triton_prefill_index_scores(q_idx, key_plane, table, start, c)
    width = prefill_score_width(start, T, c)
    assert ker.shape == (T, width) and ker.dtype == torch.float32
    assert width % BLOCK_J == 0 and width >= (start + T) // c
    for i, want in enumerate(per_row_scores(q_idx, key_plane, table, start, c)):
        nb = want.shape[0]
        assert torch.isneginf(ker[i, nb:]).all(), i
        if nb:
            torch.testing.assert_close(ker[i, :nb], want, rtol=1e-5, atol=1e-5)


def test_prefill_selection_equals_decode_selection_on_the_reference() -> None:
    """The chunk's selected tokens from prefill_index_scores (any width) equal the decode rule's."""
    start, T, c, topk = 21, 90, TINY["c"], TINY["topk"]
    _, _, key_plane, table = make_sequence(start + T, TINY, seed=3)
    q_idx, _ = chunk_queries(T, TINY, seed=4)
    scores, n_blocks = prefill_index_scores(q_idx, key_plane, table, start, c)
    positions = torch.arange(start, start + T)
    got = select_decode_tokens(scores, n_blocks, positions, c, topk)
    wide = table[None].expand(T, -1)
    max_blocks = table.shape[0] * key_plane.shape[1]
    want_scores = _index_scores_reference(q_idx, key_plane, wide, n_blocks, max_blocks)
    assert torch.equal(got, select_decode_tokens(want_scores, n_blocks, positions, c, topk))


@pytest.mark.parametrize("start,T", [(0, 5), (30, 40), (100, 33)])
def test_prefill_attention_kernel_vs_reference(start: int, T: int) -> None:
    c, topk, scaling = TINY["c"], TINY["topk"], TINY["d"] ** -0.5
    k_plane, v_plane, key_plane, table = make_sequence(start + T, TINY, seed=5)
    q_idx, q = chunk_queries(T, TINY, seed=6)
    scores, n_blocks = prefill_index_scores(q_idx, key_plane, table, start, c)
    tokens = select_decode_tokens(scores, n_blocks, torch.arange(start, start + T), c, topk)
    ref = prefill_sparse_attention(q, k_plane, v_plane, table, tokens, scaling)  # the CPU path
    assert torch.equal(
        ref, paged_sparse_attention(q, k_plane, v_plane, table[None].expand(T, -1), tokens, scaling)
    )
    wide = table[None].expand(T, -1)  # stride 0, read in place
    ker = triton_paged_sparse_attention(q, k_plane, v_plane, wide, tokens, scaling, num_splits=1)
    torch.testing.assert_close(ker, ref, rtol=1e-4, atol=1e-5)
    split = triton_paged_sparse_attention(q, k_plane, v_plane, wide, tokens, scaling, tile=16, num_splits=4)
    torch.testing.assert_close(ker, split, rtol=1e-4, atol=1e-5)


# ---- CUDA, real sizes, bf16 ---------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("start,T", [(0, 4096), (8192, 4096), (40960, 1260), (2000, 100)])
def test_cuda_prefill_chunk_matches_reference_and_repeats(start: int, T: int) -> None:
    c, topk, scaling = REAL["c"], REAL["topk"], REAL["d"] ** -0.5
    k_plane, v_plane, key_plane, table = make_sequence(start + T, REAL, torch.bfloat16, "cuda", seed=7)
    q_idx, q = chunk_queries(T, REAL, torch.bfloat16, "cuda", seed=8)

    def chunk():
        scores, n_blocks = prefill_index_scores(q_idx, key_plane, table, start, c)
        tokens = select_decode_tokens(
            scores, n_blocks, torch.arange(start, start + T, device="cuda"), c, topk
        )
        return scores, tokens, prefill_sparse_attention(q, k_plane, v_plane, table, tokens, scaling)

    scores, tokens, out = chunk()
    for x, y in zip(chunk(), (scores, tokens, out), strict=True):
        assert torch.equal(x, y)  # a chunk's result is a function of the chunk
    rows = torch.linspace(0, T - 1, 6).long().tolist()
    cpu = [t.cpu() for t in (k_plane, v_plane, key_plane, table)]
    for i in rows:
        nb = (start + i + 1) // c
        want = per_row_scores(q_idx[i : i + 1].cpu(), cpu[2], cpu[3], start + i, c)[0]
        assert torch.isneginf(scores[i, nb:]).all()
        if nb:
            torch.testing.assert_close(scores[i, :nb].cpu(), want, rtol=1e-3, atol=1e-3)
        ref = paged_sparse_attention(
            q[i : i + 1].cpu(), cpu[0], cpu[1], cpu[3][None], tokens[i : i + 1].cpu(), scaling
        )
        got = out[i].cpu().double()
        assert ((got - ref[0].double()).norm() / ref[0].double().norm()).item() < 2e-2, i
