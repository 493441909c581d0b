"""The caches of a batch of decode rows, addressed by device tensors (implements DecodeCache).

The same object serves the eager decode step and the static buffers a CUDA graph replays: only
the tensors' contents change between steps, never their shapes or addresses."""

from __future__ import annotations

import numpy as np
import torch

from ..model.batch import KVView
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


class DecodeRows:
    def __init__(
        self,
        pool: KVPool,
        states: StateSlots,
        slots: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
    ) -> None:
        """slots [B] int64; positions [B] int64 (each row's new token); block_table [B, max_pages]
        int32, padded with any page (the decode ops never read past a row's position)."""
        self.pool, self.states = pool, states
        self.slots, self.positions, self.block_table = slots, positions, block_table
        # NOTE: every attention layer writes at the same (page, offset) and block-key address, so they
        # are computed once a step (a graph records them once, at the first layer that asks).
        self._kv_addr: tuple[torch.Tensor, torch.Tensor] | None = None
        self._key_addr: tuple[torch.Tensor, torch.Tensor] | None = None

    def gdn_planes(self, gdn_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.states.gdn_planes(gdn_index)

    def ple_planes(self, ple_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.states.ple_planes(ple_index)

    def index_tail_plane(self, attn_index: int) -> torch.Tensor:
        return self.states.tail_plane(attn_index)

    def _page_of(self, index: torch.Tensor, per_page: int) -> torch.Tensor:
        """The page holding each row's `index`-th token/block: block_table[b, index[b] // per_page]."""
        col = torch.div(index, per_page, rounding_mode="floor")[:, None]
        return self.block_table.gather(1, col)[:, 0].long()

    def write_kv(self, attn_index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._kv_addr is None:
            P = self.pool.page_size
            self._kv_addr = (self._page_of(self.positions, P), self.positions % P)
        page, off = self._kv_addr
        k_plane, v_plane, _ = self.pool.planes(attn_index)
        k_plane.index_put_((page, off), k)
        v_plane.index_put_((page, off), v)

    def write_block_key(self, attn_index: int, keys: torch.Tensor) -> None:
        # NOTE: rows whose block is still open write a placeholder there too (no branch, so the step
        # can be a graph); the slot is not read before the block completes and overwrites it, and the
        # page is the row's own (reserve copied it if it was shared).
        if self._key_addr is None:
            bpp = self.pool.blocks_per_page
            block = torch.div(self.positions, self.pool.page_size // bpp, rounding_mode="floor")
            self._key_addr = (self._page_of(block, bpp), block % bpp)
        self.pool.planes(attn_index)[2].index_put_(self._key_addr, keys)

    def kv_view(self, attn_index: int) -> KVView:
        return KVView(*self.pool.planes(attn_index), self.block_table)
