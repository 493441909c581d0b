"""What one forward pass computes: rows of tokens, grouped by sequence, and each sequence's cache.

The model reads and writes per-sequence state only through `SeqCache`; how that state is laid
out (slots, pages, host copies) is the cache package's business."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class KVView:
    """One attention layer's paged planes as the decode ops read them: K, V [pages, P, Nkv, D],
    compressed indexer keys [pages, P // c, di], and each row's block table [B, max_pages] int32."""

    k: torch.Tensor
    v: torch.Tensor
    block_keys: torch.Tensor
    block_table: torch.Tensor

    @property
    def max_blocks(self) -> int:
        """Indexer blocks the block table can address (its width in blocks)."""
        return self.block_table.shape[1] * self.block_keys.shape[1]

    def rows(self, n: int) -> KVView:
        """The view for n query rows: a one-sequence table (prefill rows) repeated for each row."""
        if self.block_table.shape[0] == n:
            return self
        return KVView(self.k, self.v, self.block_keys, self.block_table.expand(n, -1).contiguous())


class SeqCache(Protocol):
    """One sequence's state as the model sees it. Indices are per layer kind (gdn / ple / attention)."""

    def gdn_state(self, gdn_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv history [conv_dim, K-1], recurrent state [Hv, dk, dv] float32), updated in place."""
        ...

    def ple_state(self, ple_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n-gram context ids [N-1], conv history [nH, (Kp-1)*N]), updated in place."""
        ...

    def index_tail(self, attn_index: int) -> torch.Tensor:
        """Raw indexer keys of the open block [c-1, di]; row r is position block_start + r."""
        ...

    def write_kv(self, attn_index: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, Nkv, D] at positions start .. start+n-1."""
        ...

    def write_block_keys(self, attn_index: int, first_block: int, keys: torch.Tensor) -> None:
        """Store compressed indexer keys [m, di] of blocks first_block .. first_block+m-1."""
        ...

    def kv_view(self, attn_index: int) -> KVView:
        """The layer's paged planes with this sequence's block table as one row [1, pages]."""
        ...


@dataclass
class SeqChunk:
    """`n` consecutive tokens of one sequence starting at absolute position `start`."""

    cache: SeqCache
    start: int
    n: int


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, the chunks' tokens back to back
    positions: torch.Tensor  # [T] int64
    chunks: list[SeqChunk]
    # NOTE: decode, batched decode and verify windows run row-invariant, so every row gets the
    # bits it gets alone (C1). Prefill chunks run as one call, exactly as the serial reference.
    row_invariant: bool

    def spans(self) -> list[tuple[int, int]]:
        out, off = [], 0
        for ch in self.chunks:
            out.append((off, off + ch.n))
            off += ch.n
        return out

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])


class DecodeCache(Protocol):
    """The caches of B decode rows (one new token each, distinct sequences), addressed only through
    device tensors, so one decode step can be captured once and replayed as a CUDA graph.
    State planes hold every slot [S, ...]; `slots` [B] picks each row's."""

    slots: torch.Tensor

    def gdn_planes(self, gdn_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv histories [S, conv_dim, K-1], recurrent states [S, Hv, dk, dv] float32)."""
        ...

    def ple_planes(self, ple_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n-gram contexts [S, N-1] int64, conv histories [S, nH, (Kp-1)*N])."""
        ...

    def index_tail_plane(self, attn_index: int) -> torch.Tensor:
        """Raw indexer keys of each slot's open block [S, c-1, di]."""
        ...

    def write_kv(self, attn_index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store each row's k, v [B, Nkv, D] at its position."""
        ...

    def write_block_key(self, attn_index: int, keys: torch.Tensor) -> None:
        """Store keys [B, di] as the compressed key of the block holding each row's position."""
        ...

    def kv_view(self, attn_index: int) -> KVView: ...

    def keep_state(self, *planes: torch.Tensor) -> None:
        """After the rows updated their slots in `planes` (one layer's state planes [S, ...]): copy those
        slots' rows where a rewind finds them (a verify window's step); nothing for a plain decode step."""
        ...


@dataclass
class DecodeBatch:
    """B decode rows: one token per sequence, every row computed row-invariantly (C1)."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    cache: DecodeCache

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class WindowBatch:
    """W decode steps of the same B sequences in one forward: B verify windows of W rows, step-major (row
    j*B + b is sequence b's j-th token). Ops that read or write a row's state (convs, recurrences, the
    indexer's open block, KV and attention) run step by step, each step a DecodeBatch of B rows, exactly
    as W serial decode steps; the rest (projections, norms, MoE, hyper-connections) run on all W*B rows
    at once, which is where a window is cheaper than W steps. A decode step is the window of W = 1."""

    input_ids: torch.Tensor  # [W*B] int64
    positions: torch.Tensor  # [W*B] int64
    steps: tuple[DecodeBatch, ...]  # W; step j's tensors are rows j*B .. (j+1)*B of the above

    @classmethod
    def of(cls, batch: DecodeBatch) -> WindowBatch:
        """One decode step as a window of one row per sequence."""
        return cls(batch.input_ids, batch.positions, (batch,))

    def rows(self) -> list[tuple[slice, DecodeBatch]]:
        """(rows of step j in the W*B, step j) in step order."""
        B = self.steps[0].num_rows
        return [(slice(j * B, (j + 1) * B), step) for j, step in enumerate(self.steps)]


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Steps' or chunks' outputs back to back (no copy for a single one: a decode step or a one-chunk
    prefill stays as it was)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)
