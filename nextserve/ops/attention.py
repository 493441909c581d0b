"""QSA: indexer block selection and attention over the selected tokens."""

import math

import torch

from .pointwise import rowwise
from .triton import use_kernel

PREFILL_TILE = 32  # tokens a tile of a prefill row's attention (benchmarks/bench_kernels.py qsa_prefill)


def sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: list[torch.Tensor], scaling: float
) -> torch.Tensor:
    """q [T, Nq, D]; k, v [t, Nkv, D] the sequence's whole context; selected[i] the token ids row i
    sees. Softmax in float32, products in the model dtype. Returns [T, Nq, D].

    # NOTE: one row at a time over its own gathered keys: a row's bits never depend on the others.
    """
    Nq, Nkv = q.shape[1], k.shape[1]
    rep = Nq // Nkv
    rows = []
    for i, idx in enumerate(selected):
        ks = k.index_select(0, idx).repeat_interleave(rep, dim=1).transpose(0, 1)  # [Nq, n, D]
        vs = v.index_select(0, idx).repeat_interleave(rep, dim=1).transpose(0, 1)  # [Nq, n, D]
        scores = torch.matmul(q[i][:, None, :], ks.transpose(1, 2)) * scaling  # [Nq, 1, n]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        rows.append(torch.matmul(probs, vs)[:, 0, :])  # [Nq, D]
    return torch.stack(rows)


# ---- batched decode over the paged KV cache (graph-capturable on CUDA) ----------------------------


def index_scores(
    q_idx: torch.Tensor,
    key_plane: torch.Tensor,
    block_table: torch.Tensor,
    n_blocks: torch.Tensor,
    max_blocks: int,
) -> torch.Tensor:
    """Indexer block scores of a batch of decode rows, keys read through the block table.

    q_idx [B, Ni, di]; key_plane [pages, bpp, di] (block j of row b at page block_table[b, j // bpp],
    index j % bpp); block_table [B, maxP]; n_blocks [B] complete blocks per row. Returns
    [B, max_blocks] float32: sum_h relu(q_h . k_j) / sqrt(di) as the per-row rule scores them (float32),
    -inf for j >= n_blocks[b].

    # On CUDA one Triton kernel (ops/triton/qsa_decode.py); the per-row loop below is its reference
    # and gives the per-row rule's scores bit for bit (tests/qsa_reference.py).
    """
    if use_kernel(q_idx):
        from .triton.qsa_decode import triton_index_scores

        return triton_index_scores(q_idx, key_plane, block_table, n_blocks, max_blocks)
    return _index_scores_reference(q_idx, key_plane, block_table, n_blocks, max_blocks)


def _index_scores_reference(q_idx, key_plane, block_table, n_blocks, max_blocks: int) -> torch.Tensor:
    B, bpp, dev = q_idx.shape[0], key_plane.shape[1], q_idx.device
    scale = math.sqrt(q_idx.shape[-1])
    out = torch.full((B, max_blocks), float("-inf"), dtype=torch.float32, device=dev)
    for row in range(B):
        nb = int(n_blocks[row])
        if nb == 0:
            continue
        blocks = torch.arange(nb, device=dev)
        keys = key_plane[block_table[row].long()[blocks // bpp], blocks % bpp]  # [nb, di]
        scores = torch.matmul(q_idx[row].float(), keys.float().t())  # [Ni, nb]
        out[row, :nb] = torch.relu(scores.t()).sum(dim=-1) / scale
    return out


def prefill_index_scores(
    q_idx: torch.Tensor, key_plane: torch.Tensor, table_row: torch.Tensor, start: int, c: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer block scores of a prefill chunk's rows, positions start .. start+T-1 of one sequence:
    q_idx [T, Ni, di]; key_plane [pages, bpp, di]; table_row [maxP] the sequence's block table.
    Returns (scores [T, M] float32 as `index_scores` defines them, M at least the last row's block
    count; n_blocks [T] int64, each row's complete blocks (position + 1) // c).

    # On CUDA one Triton kernel over tiles of rows and blocks on tensor cores (ops/triton/qsa_prefill.py,
    # for prefill chunks only: its bits differ from the decode kernel's); the per-row rule below is its
    # reference and the CPU path.
    """
    T = q_idx.shape[0]
    positions = torch.arange(start, start + T, device=q_idx.device)
    n_blocks = torch.div(positions + 1, c, rounding_mode="floor")
    if use_kernel(q_idx):
        from .triton.qsa_prefill import triton_prefill_index_scores

        return triton_prefill_index_scores(q_idx, key_plane, table_row, start, c), n_blocks
    width = max(1, (start + T) // c)
    table = table_row[None, :].expand(T, -1)
    return _index_scores_reference(q_idx, key_plane, table, n_blocks, width), n_blocks


def indexer_open_block(
    raw: torch.Tensor,
    tail_plane: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    c: int,
    row_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each decode row's open indexer block with its raw key put in at position % c: raw [B, di]; the tail
    plane [S, c-1, di] of the rows' slots is updated in place. Returns the mean of the block's c rows
    [B, di] (raw's dtype, computed in float32) and the block's first position [B]. Where a row completes
    its block the mean is the block's pooled key; elsewhere it is a placeholder (stale tail rows in it).

    # On CUDA one Triton launch (ops/triton/qsa_tail.py); the code below is its reference and the CPU
    # path."""
    if use_kernel(raw, tail_plane) and raw.stride(-1) == 1 and tail_plane.is_contiguous():
        from .triton.qsa_tail import triton_indexer_open_block

        return triton_indexer_open_block(raw, tail_plane, slots, positions, c)
    return _indexer_open_block_reference(raw, tail_plane, slots, positions, c, row_invariant)


def _indexer_open_block_reference(raw, tail_plane, slots, positions, c: int, row_invariant: bool = False):
    B, di = raw.shape
    r = positions % c  # the row's place in its block
    block = torch.cat([tail_plane.index_select(0, slots), raw[:, None, :]], dim=1)  # [B, c, di]
    block = block.scatter(1, r[:, None, None].expand(B, 1, di), raw[:, None, :])
    tail_plane.index_copy_(0, slots, block[:, : c - 1])
    return block_mean(block, row_invariant), positions - r


def block_mean(blocks: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
    """blocks [m, c, di] -> their mean over c [m, di], in float32, rounded to the blocks' dtype."""
    return rowwise(lambda b: b.float().mean(dim=1).to(b.dtype), blocks, row_invariant)


def select_decode_tokens(
    scores: torch.Tensor, n_blocks: torch.Tensor, positions: torch.Tensor, c: int, block_topk: int
) -> torch.Tensor:
    """The tokens each decode row attends to, from `index_scores`: [B, block_topk * c + c] int32.

    The top `block_topk` blocks by score (ties: the lower block first), those below n_blocks[b] kept,
    in ascending order, each as its c tokens; then the open tail n_blocks*c .. positions[b] (at most
    c tokens); then -1. Valid entries come first, ascending: the per-row rule of
    tests/qsa_reference.py.

    # On CUDA one Triton kernel (ops/triton/qsa_select.py): a radix select per row over its first
    # n_blocks scores, where two full-width sorts cost time growing with M (max_context / c) on every
    # step. The sorts below are its reference, equal to it for every input (torch.equal).
    # NOTE: static shapes, no host reads on both paths (graph-capturable); a row's tokens depend on
    # its own scores, n_blocks and position only; scores from column n_blocks[b] on must be -inf.
    """
    if use_kernel(scores):
        from .triton.qsa_select import triton_select_decode_tokens

        return triton_select_decode_tokens(scores, n_blocks, positions, c, block_topk)
    return _select_decode_tokens_reference(scores, n_blocks, positions, c, block_topk)


def _select_decode_tokens_reference(
    scores: torch.Tensor, n_blocks: torch.Tensor, positions: torch.Tensor, c: int, block_topk: int
) -> torch.Tensor:
    B, M = scores.shape
    dev = scores.device
    k = min(block_topk, M)
    L = block_topk * c + c
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]  # [B, k]
    nb = n_blocks.to(torch.int64)[:, None]
    keep = order < nb
    blocks = torch.where(keep, order, M).sort(dim=-1).values  # kept ones first, ascending
    block_tokens = (blocks[:, :, None] * c + torch.arange(c, device=dev)).flatten(1)  # [B, k*c]
    block_tokens = torch.cat([block_tokens, block_tokens.new_zeros(B, L - k * c)], dim=1)
    n_sel = keep.sum(dim=-1, keepdim=True) * c
    n_tail = (positions.to(torch.int64)[:, None] + 1 - nb * c).clamp(0, c)
    idx = torch.arange(L, device=dev)[None, :]
    tail_tokens = nb * c + idx - n_sel
    out = torch.where(idx < n_sel, block_tokens, torch.where(idx < n_sel + n_tail, tail_tokens, -1))
    return out.to(torch.int32)


def paged_sparse_attention(
    q: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    block_table: torch.Tensor,
    tokens: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Batched decode attention over the paged cache: q [B, Nq, D]; k_plane, v_plane
    [pages, P, Nkv, D] (token t of row b at page block_table[b, t // P], offset t % P);
    tokens [B, L] int32 (-1 = none). Returns [B, Nq, D] in q.dtype.

    # On CUDA two Triton kernels (split token list, fixed combine; ops/triton/qsa_decode.py); the
    # per-row loop below is their reference: `sparse_attention` on the gathered tokens, bit for bit.
    """
    if use_kernel(q):
        from .triton.qsa_decode import triton_paged_sparse_attention

        return triton_paged_sparse_attention(q, k_plane, v_plane, block_table, tokens, scaling)
    return _paged_sparse_attention_reference(q, k_plane, v_plane, block_table, tokens, scaling)


def prefill_sparse_attention(
    q: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    table_row: torch.Tensor,
    tokens: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """`paged_sparse_attention` of a prefill chunk's rows [T, Nq, D], which share one sequence's block
    table table_row [maxP]. On CUDA the decode kernels with each row's token list in one split (a chunk
    has rows enough to fill the GPU; no partial results to write and merge) and the table read in place
    for every row; the same per-row reference."""
    table = table_row[None, :].expand(q.shape[0], -1)  # [T, maxP], stride 0: no copy
    if use_kernel(q):
        from .triton.qsa_decode import triton_paged_sparse_attention

        return triton_paged_sparse_attention(
            q, k_plane, v_plane, table, tokens, scaling, tile=PREFILL_TILE, num_splits=1
        )
    return _paged_sparse_attention_reference(q, k_plane, v_plane, table, tokens, scaling)


def _paged_sparse_attention_reference(q, k_plane, v_plane, block_table, tokens, scaling: float):
    P = k_plane.shape[1]
    rows = []
    for row in range(q.shape[0]):
        tok = tokens[row][tokens[row] >= 0].long()
        pages = block_table[row].long()[tok // P]
        k, v = k_plane[pages, tok % P], v_plane[pages, tok % P]  # [n, Nkv, D]
        idx = torch.arange(tok.shape[0], device=q.device)
        rows.append(sparse_attention(q[row : row + 1], k, v, [idx], scaling)[0])
    return torch.stack(rows) if rows else torch.empty_like(q)
