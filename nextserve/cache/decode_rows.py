"""The caches of a batch of decode rows, addressed by device tensors (implements DecodeCache).

The same object serves the eager decode step and the static buffers a CUDA graph replays: only
the tensors' contents change between steps, never their shapes or addresses."""

from __future__ import annotations

import numpy as np
import torch

from ..model.batch import DecodeBatch, KVView, WindowBatch
from ..ops.paged import write_paged_rows
from ..ops.pinned import upload
from ..ops.tokens import resolve_pending_ids
from .kv_pool import KVPool
from .states import StateSlots


def fill_block_tables(out: np.ndarray, tables: list[list[int]], pad: int) -> None:
    """out [rows, width] (int32): row r is tables[r] padded with `pad`, rows past the tables all `pad`.
    Through numpy: a list into a slice is one C loop (a torch.tensor per row cost ~10x more)."""
    out[:] = pad
    for r, table in enumerate(tables):
        if len(table) > out.shape[1]:
            raise ValueError(f"block table of {len(table)} pages exceeds the {out.shape[1]} of the batch")
        out[r, : len(table)] = table


# Fields of a window's host inputs and meta rows: token ids, positions, state slots, keep slots, table rows.
WINDOW_FIELDS = 5


def fill_window(
    meta: np.ndarray,
    table: np.ndarray | None,
    inputs: np.ndarray,
    tables: list[list[int]],
    G: int,
    scratch_slot: int,
    scratch_page: int,
    W: int | None = None,
) -> None:
    """Lay out W_in steps of B rows (inputs [5, W_in, B] int64) as W >= W_in steps (default W_in) of G >= B
    rows: meta [5, >= W*G] gets row j*G + b; the rest is padding (token 0 at position 0 on the scratch
    slot, reading table row G), as are the rows whose table row is -1. table [>= G+1, max_pages] gets
    the B block tables, rows B .. G scratch pages."""
    _, W_in, B = inputs.shape
    W = W or W_in
    m = meta[:, : W * G].reshape(WINDOW_FIELDS, W, G)  # a view: splitting the contiguous last axis
    m[:] = np.array([0, 0, scratch_slot, scratch_slot, G])[:, None, None]
    m[:, :W_in, :B] = inputs
    m[4, :W_in, :B][inputs[4] < 0] = G
    if table is not None:  # None: filled already, for another meta over the same rows
        fill_block_tables(table[: G + 1], tables, scratch_page)


class DecodeRows:
    def __init__(
        self,
        pool: KVPool,
        states: StateSlots,
        slots: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        keep_slots: torch.Tensor | None = None,
    ) -> None:
        """slots [B] int64; positions [B] int64 (each row's new token); block_table [B, max_pages]
        int32, padded with any page (the decode ops never read past a row's position); keep_slots [B]
        int64: where `keep_state` copies each row's state (a verify window's step), or None."""
        self.pool, self.states = pool, states
        self.slots, self.positions, self.block_table = slots, positions, block_table
        self.keep_slots = keep_slots

    def gdn_planes(self, gdn_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.states.gdn_planes(gdn_index)

    def ple_planes(self, ple_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.states.ple_planes(ple_index)

    def index_tail_plane(self, attn_index: int) -> torch.Tensor:
        return self.states.tail_plane(attn_index)

    def write_kv(self, attn_index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k_plane, v_plane, _ = self.pool.planes(attn_index)
        write_paged_rows((k_plane, v_plane), (k, v), self.block_table, self.positions, self.pool.page_size)

    def write_block_key(self, attn_index: int, keys: torch.Tensor) -> None:
        # NOTE: rows whose block is still open write a placeholder there too (no branch, so the step
        # can be a graph); the slot is not read before the block completes and overwrites it, and the
        # page is the row's own (reserve copied it if it was shared).
        bpp, key_plane = self.pool.blocks_per_page, self.pool.planes(attn_index)[2]
        c = self.pool.page_size // bpp  # tokens a block
        write_paged_rows((key_plane,), (keys,), self.block_table, self.positions, bpp, c)

    def kv_view(self, attn_index: int) -> KVView:
        return KVView(*self.pool.planes(attn_index), self.block_table)

    def keep_state(self, *planes: torch.Tensor) -> None:
        # NOTE: padding rows keep from and to the scratch slot; duplicate targets there are harmless.
        if self.keep_slots is None:
            return
        for plane in planes:
            plane.index_copy_(0, self.keep_slots, plane.index_select(0, self.slots))


def window_batch(
    pool: KVPool,
    states: StateSlots,
    meta: torch.Tensor,
    table: torch.Tensor,
    W: int,
    B: int,
    keep: bool = True,
    gather: bool | None = None,
    pending: torch.Tensor | None = None,
) -> WindowBatch:
    """The WindowBatch of W steps of B rows over device tensors: meta [5, >= W*B] int64 (ids, positions,
    slots, keep slots, table rows; row j*B + b is sequence b's j-th token), table [rows, max_pages] int32.
    W = 1 is a decode step: its rows read table[:B] directly (unless `gather`: rows whose table row may
    be padding's) and keep nothing; `keep` False: no step keeps its state (MTP rows). `pending`: the
    previous decode step's sampled tokens on the device, which ids of -(1 + r) name (ops/tokens.py).

    # NOTE: each step's block table is a gather of `table` rows (a window's padding rows read a row of
    # scratch pages, so the table goes to the device once, not once per step); only steps 0 .. W-2 keep
    # their state: the last one's is the slot's own."""
    if pending is not None:
        resolve_pending_ids(meta[0, : W * B], pending)
    steps = []
    for j in range(W):
        r = slice(j * B, (j + 1) * B)
        ids, pos, slots, keep_slots, rows = meta[0, r], meta[1, r], meta[2, r], meta[3, r], meta[4, r]
        step_table = table.index_select(0, rows) if (W > 1 if gather is None else gather) else table[:B]
        kept = keep_slots if keep and j < W - 1 else None
        steps.append(DecodeBatch(ids, pos, DecodeRows(pool, states, slots, pos, step_table, kept)))
    n = W * B
    return WindowBatch(meta[0, :n], meta[1, :n], tuple(steps))


def eager_window(
    pool: KVPool,
    states: StateSlots,
    inputs: np.ndarray,
    tables: list[list[int]],
    device: torch.device,
    keep: bool = True,
    gather: bool | None = None,
    pending: torch.Tensor | None = None,
) -> WindowBatch:
    """window_batch over host inputs [5, W, B] (fill_window) laid out for exactly their B rows and moved
    to `device`: a window run eagerly, without a graph's static buffers."""
    _, W, B = inputs.shape
    meta = np.empty((WINDOW_FIELDS, W * B), dtype=np.int64)
    table = np.empty((B + 1, max(len(t) for t in tables)), dtype=np.int32)
    fill_window(meta, table, inputs, tables, B, states.scratch_slot, pool.scratch_page)
    meta_t, table_t = upload(meta, torch.int64, device), upload(table, torch.int32, device)
    return window_batch(pool, states, meta_t, table_t, W, B, keep, gather, pending)
