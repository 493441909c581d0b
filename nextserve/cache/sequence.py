"""One sequence's cache: its state slot and its block table. Implements the model's SeqCache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.batch import KVView
from ..ops.pinned import upload
from .kv_pool import KVPool, PoolExhausted
from .states import StateSlots


@dataclass
class SequenceImage:
    """A snapshot of a sequence at `length` tokens: a copy of its state slot and shared references
    to its KV pages (copy-on-write). Taken only on the prefill chunk grid (C1)."""

    length: int
    state: dict[str, torch.Tensor]
    pages: list[int]
    released: bool = False


def release_image(pool: KVPool, image: SequenceImage) -> None:
    """Drop an image's page references (once; a second call does nothing)."""
    if not image.released:
        pool.release(image.pages)
        image.released = True


class SequenceCache:
    def __init__(
        self,
        pool: KVPool,
        slots: StateSlots,
        slot: int | None = None,
        block_table: list[int] | None = None,
        lag: int = 0,
    ) -> None:
        """A new sequence's cache (a freshly reset slot, no pages); or, given `slot` and `block_table`,
        a view of a sequence whose slot and pages another holder allocated (a pipeline stage mirrors
        the driver's allocation on its own planes): nothing is taken here, and `free` is not called.
        `lag`: positions before `length` the sequence still writes (1 when the MTP drafts: its row
        length-1 runs once the token at length is known), so their pages are its own too."""
        self.pool, self.slots, self.lag = pool, slots, lag
        self.slot = slots.alloc() if slot is None else slot
        self.block_table: list[int] = list(block_table or [])
        self._table_list: list[int] | None = None  # what _table_dev was built from
        self._table_dev: torch.Tensor | None = None
        self._table32: torch.Tensor | None = None  # the same, int32 [1, pages], as the paged ops take it
        self.length = 0  # tokens whose KV and state are committed

    # ---- sizing --------------------------------------------------------------------------------
    def _shared_writable(self, tokens: int) -> list[int]:
        """Table indices of shared pages that writes at positions length .. tokens-1 would touch."""
        if tokens <= self.length:
            return []
        last = min(len(self.block_table), self.pool.pages_for(tokens))
        first = max(self.length - self.lag, 0) // self.pool.page_size
        return [i for i in range(first, last) if self.pool.refcount[self.block_table[i]] > 1]

    def pages_needed(self, tokens: int) -> int:
        """Free pages `reserve(tokens)` takes: new pages plus copies of shared pages it will write."""
        new = max(0, self.pool.pages_for(tokens) - len(self.block_table))
        return new + len(self._shared_writable(tokens))

    def reserve(self, tokens: int) -> None:
        """Make room for positions 0 .. tokens-1: after it, writes below `tokens` never allocate.

        # NOTE: a shared (image) page that those writes touch is copied here, not at the write, so a
        # forward never runs out of pages halfway (C2). All or nothing: PoolExhausted changes nothing.
        """
        if self.pages_needed(tokens) > self.pool.num_free:
            raise PoolExhausted(f"asked for {self.pages_needed(tokens)} KV pages, {self.pool.num_free} free")
        shared = self._shared_writable(tokens)
        if shared:
            self._own_pages(shared[0], shared[-1])
        need = self.pool.pages_for(tokens) - len(self.block_table)
        if need > 0:
            self.block_table += self.pool.alloc(need)

    def free(self) -> None:
        self.pool.release(self.block_table)
        self.block_table = []
        if self.slot is not None:
            self.slots.release(self.slot)
            self.slot = None

    # ---- images --------------------------------------------------------------------------------
    def snapshot(self) -> SequenceImage:
        """An image at `length`. A page the sequence writes again (a partly filled last page, or the
        page of position length - lag) goes to the image and the sequence writes on in a copy taken now
        (one free page, else PoolExhausted and no image): its later writes stay within what it reserved."""
        n = self.pool.pages_for(self.length)
        first = max(self.length - self.lag, 0) // self.pool.page_size  # the first page written again
        if first < n and self.pool.num_free < n - first:
            raise PoolExhausted("no free KV page to split a page the sequence writes again off an image")
        pages = self.block_table[:n]
        self.pool.incref(pages)
        image = SequenceImage(self.length, self.slots.copy_out(self.slot), list(pages))
        if first < n:
            self._own_pages(first, n - 1)
        return image

    def restore(self, image: SequenceImage) -> None:
        """Become the sequence the image was taken of; pages stay shared until `reserve` copies the
        ones it will write (call it before the next forward)."""
        self.pool.release(self.block_table)
        self.pool.incref(image.pages)
        self.block_table = list(image.pages)
        self.slots.copy_in(self.slot, image.state)
        self.length = image.length

    def release_image(self, image: SequenceImage) -> None:
        release_image(self.pool, image)

    # ---- SeqCache ------------------------------------------------------------------------------
    def gdn_state(self, gdn_index: int):
        conv, rec = self.slots.gdn_planes(gdn_index)
        return conv[self.slot], rec[self.slot]

    def ple_state(self, ple_index: int):
        ctx, conv = self.slots.ple_planes(ple_index)
        return ctx[self.slot], conv[self.slot]

    def index_tail(self, attn_index: int) -> torch.Tensor:
        return self.slots.tail_plane(attn_index)[self.slot]

    def _own_pages(self, first: int, last: int) -> None:
        """Copy-on-write: pages first..last of the table become this sequence's own."""
        for i in range(first, last + 1):
            page = self.block_table[i]
            if self.pool.refcount[page] > 1:
                (new,) = self.pool.alloc(1)
                self.pool.copy_page(page, new)
                self.pool.release([page])
                self.block_table[i] = new

    def own_page_at(self, position: int) -> None:
        """Make the page holding `position` this sequence's own before a decode step writes it (a
        no-op after `reserve`, which already copied shared pages below its token count)."""
        page = position // self.pool.page_size
        self._own_pages(page, page)

    def _table(self) -> torch.Tensor:
        """The block table as a tensor on the pool's device, rebuilt only when the table changed.

        # NOTE: built once per change, not once per layer call: a host-to-device copy per layer per
        # step was a large part of a GPU decode step's launches."""
        if self._table_list != self.block_table:
            self._table_list = list(self.block_table)
            self._table_dev = upload(self.block_table, torch.long, self.pool.device)
            self._table32 = self._table_dev.to(torch.int32)[None]
        return self._table_dev

    def _addresses(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        P = self.pool.page_size
        self._own_pages(start // P, (start + n - 1) // P)
        pos = torch.arange(start, start + n, device=self.pool.device)
        return self._table()[pos // P], pos % P

    def write_kv(self, attn_index: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        pages, offs = self._addresses(start, k.shape[0])
        k_plane, v_plane, _ = self.pool.planes(attn_index)
        k_plane[pages, offs] = k
        v_plane[pages, offs] = v

    def write_block_keys(self, attn_index: int, first_block: int, keys: torch.Tensor) -> None:
        bpp, c, P = (
            self.pool.blocks_per_page,
            self.pool.page_size // self.pool.blocks_per_page,
            self.pool.page_size,
        )
        last_block = first_block + keys.shape[0] - 1
        self._own_pages(first_block * c // P, last_block * c // P)
        blocks = torch.arange(first_block, last_block + 1, device=self.pool.device)
        self.pool.planes(attn_index)[2][self._table()[blocks // bpp], blocks % bpp] = keys

    def kv_view(self, attn_index: int) -> KVView:
        self._table()
        return KVView(*self.pool.planes(attn_index), self._table32)

    # ---- reading back (tests and tools; the model reads through kv_view) -------------------------
    def read_kv(self, attn_index: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._table()[: self.pool.pages_for(length)]
        k_plane, v_plane, _ = self.pool.planes(attn_index)
        return k_plane[table].flatten(0, 1)[:length], v_plane[table].flatten(0, 1)[:length]

    def read_block_keys(self, attn_index: int, n_blocks: int) -> torch.Tensor:
        table = self._table()[: -(-n_blocks // self.pool.blocks_per_page)]
        return self.pool.planes(attn_index)[2][table].flatten(0, 1)[:n_blocks]
