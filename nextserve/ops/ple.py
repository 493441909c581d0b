"""PLE ops: the hashed n-gram context of a token (with eos reset), a decode step's table rows, the table
lookup (from device or pinned host memory), and the key-query gate of the embedded value into the streams.

# On CUDA the decode step's context + hash + context update is one Triton kernel, and so is the gate
# (ops/triton/ple.py), both row-invariant by construction and graph-capturable. The torch code below is
# their reference (and the CPU path), bit for bit the code the model ran before the kernels.
"""

import math

import torch

from .pointwise import rowwise
from .triton import use_kernel


def ngram_contexts(history: torch.Tensor, n_new: int, ngram_size: int, eos: int) -> torch.Tensor:
    """history [..., N-1 + n_new] ids (the carried context, then the new tokens) -> c [..., n_new, N]:
    c[..., s] = token_{t-s}, or eos if t-s is before the start or an eos lies strictly between."""
    ctx = history.shape[-1] - n_new
    cols = [history[..., ctx:]]
    blocked = torch.zeros_like(cols[0], dtype=torch.bool)
    for s in range(1, ngram_size):
        prev = history[..., ctx - s : ctx - s + n_new]
        cols.append(torch.where(blocked, torch.full_like(prev, eos), prev))
        blocked = blocked | (prev == eos)
    return torch.stack(cols, dim=-1)


def ngram_ids(
    contexts: torch.Tensor, mult: torch.Tensor, sizes: torch.Tensor, offsets: torch.Tensor, per_order: int
) -> torch.Tensor:
    """contexts [T, N] -> table rows [T, n_heads]: order-k heads hash XOR_{i<k} c_i * m_i (int64 products
    that wrap around), then take it modulo their prime (a floor remainder: never negative) plus offset."""
    out = []
    h = contexts[:, 0] * mult[0]
    for k in range(2, mult.shape[0] + 1):
        h = torch.bitwise_xor(h, contexts[:, k - 1] * mult[k - 1])
        lo = (k - 2) * per_order
        sz = sizes[lo : lo + per_order]
        out.append(torch.remainder(h[:, None], sz[None, :]) + offsets[lo : lo + per_order])
    return torch.cat(out, dim=1)


def ple_decode_ids(
    ctx_plane: torch.Tensor,
    slots: torch.Tensor,
    input_ids: torch.Tensor,
    mult: torch.Tensor,
    sizes: torch.Tensor,
    offsets: torch.Tensor,
    eos: int,
    per_order: int,
) -> torch.Tensor:
    """One decode token per row: ctx_plane [S, N-1] int64 (each slot's last N-1 ids), slots [B] (distinct),
    input_ids [B] -> table rows [B, n_heads] int64 of each row's n-gram context; ctx_plane[slots] is
    shifted in place to end with the new token."""
    # NOTE: an integer op, exact (the kernel gives the reference's bits whatever the model dtype).
    ts = (ctx_plane, slots, input_ids, mult, sizes, offsets)
    if use_kernel(*ts, dtypes=(torch.int64,)) and ctx_plane.shape[1] >= 1:
        from .triton.ple import triton_ple_decode_ids

        return triton_ple_decode_ids(ctx_plane, slots, input_ids, mult, sizes, offsets, eos, per_order)
    N = ctx_plane.shape[1] + 1
    hist = torch.cat([ctx_plane.index_select(0, slots), input_ids[:, None]], dim=1)  # [B, N]
    ids = ngram_ids(ngram_contexts(hist, 1, N, eos)[:, 0], mult, sizes, offsets, per_order)
    ctx_plane.index_copy_(0, slots, hist[:, 1:])
    return ids


def lookup_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The table's rows at ids [T, heads] -> [T, heads, D] on ids' device.

    # NOTE: the n-gram table (51B parameters in the released model) may live in pinned host memory
    # (--ple-table host), as may a pipeline's last-stage copy of the token embeddings its MTP block
    # reads (--head-embedding host), while ids are on the GPU: then one Triton launch reads the rows from
    # host memory directly (zero-copy, through unified addressing), with no host synchronisation, so a
    # decode step stays one CUDA graph; the values are the same bits F.embedding gives (a copy of each
    # row)."""
    if ids.is_cuda and not table.is_cuda:
        from .triton.ple import triton_host_rows

        return triton_host_rows(table, ids)
    return torch.nn.functional.embedding(ids, table)


def ple_gate(
    key: torch.Tensor, query: torch.Tensor, value: torch.Tensor, n: int, H: int, row_invariant: bool = False
) -> torch.Tensor:
    """key, query [T, n*H] (normed), value [T, H] (one dtype) -> gated value [T, n*H]: per stream s,
    sigmoid(g_s) * value with g_s = sign(d_s) sqrt(max(|d_s|, 1e-6)), d_s = key_s . query_s / sqrt(H)."""
    if use_kernel(key, query, value) and key.dtype == query.dtype == value.dtype:
        from .triton.ple import triton_ple_gate

        return triton_ple_gate(key, query, value, n, H)
    T = key.shape[0]
    d = (key.view(T, n, H) * query.view(T, n, H)).sum(dim=-1, keepdim=True) / math.sqrt(H)  # [T, n, 1]
    gate = d.abs().clamp_min(1e-6).sqrt() * d.sign()
    return (rowwise(torch.sigmoid, gate, row_invariant) * value.unsqueeze(-2)).flatten(-2)  # [T, nH]
