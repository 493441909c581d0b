"""The indexer's block selection written out row by row: the readable definition that
nextserve.ops.attention's batched `index_scores` + `select_decode_tokens` are tested against."""

import math

import torch


def select_tokens(
    q_idx: torch.Tensor,
    block_keys: torch.Tensor,
    positions: list[int],
    compress_ratio: int,
    block_topk: int,
) -> list[torch.Tensor]:
    """Which context tokens each query row attends to.

    q_idx [T, Ni, di] (normed, roped indexer queries); block_keys [nb, di] (compressed, normed,
    roped keys of every complete block so far); positions: each row's absolute position.
    Returns, per row, the ascending token indices: the top `block_topk` visible blocks by
    sum_h relu(q_h . k_j) / sqrt(di) (all of them when few), then the open tail block. Equal
    scores (relu makes exact zeros common) go to the lower block: a rule every device and batch
    size computes alike, where torch.topk leaves the order of ties to the implementation.

    # NOTE: row t sees only the floor((t+1)/c) blocks complete at t, so rows are independent and
    # a chunk gives each row what a one-token step gives it.
    """
    c = compress_ratio
    scale = math.sqrt(q_idx.shape[-1])
    out = []
    for row, t in enumerate(positions):
        n_blocks = (t + 1) // c
        if n_blocks > block_topk:
            scores = torch.matmul(q_idx[row].float(), block_keys[:n_blocks].float().t())  # [Ni, nb]
            scores = torch.relu(scores.t()).sum(dim=-1) / scale  # [nb]
            blocks = torch.sort(scores, descending=True, stable=True).indices[:block_topk].sort().values
        else:
            blocks = torch.arange(n_blocks, device=q_idx.device)
        tokens = (blocks[:, None] * c + torch.arange(c, device=q_idx.device)[None, :]).flatten()
        tail = torch.arange(n_blocks * c, t + 1, device=q_idx.device)
        out.append(torch.cat([tokens, tail]))
    return out
