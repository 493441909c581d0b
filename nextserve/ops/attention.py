"""QSA: indexer block selection and attention over the selected tokens."""

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
    sum_h relu(q_h . k_j) / sqrt(di) (all of them when few), then the open tail block.

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
            blocks = scores.topk(block_topk, dim=0).indices.sort().values
        else:
            blocks = torch.arange(n_blocks, device=q_idx.device)
        tokens = (blocks[:, None] * c + torch.arange(c, device=q_idx.device)[None, :]).flatten()
        tail = torch.arange(n_blocks * c, t + 1, device=q_idx.device)
        out.append(torch.cat([tokens, tail]))
    return out


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
