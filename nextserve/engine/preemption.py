"""Preemption to host memory: when decode runs out of KV pages, a running sequence's state slot and pages
are copied to host memory and freed, and copied back into a fresh slot and fresh pages when it is admitted
again. The copies are bit for bit, so a preempted sequence continues exactly as it would have (C1), and
no request is cut short by another's use of the pool (C2)."""

from __future__ import annotations

import logging

from ..cache.host_store import HostImage, HostImageStore, spill, unspill
from ..cache.kv_pool import KVPool
from ..cache.sequence import SequenceCache, SequenceImage, release_image
from ..cache.states import StateSlots
from .sequence import Sequence

log = logging.getLogger("nextserve.engine")


class Swapper:
    """The host copies of preempted sequences, within `max_bytes` of host memory shared with the host
    image store (`store`, whose prefix images are only a cache: they make room first).

    # NOTE: a preempted sequence's copy is owed to its request, never dropped while it waits: where even
    # an empty image store leaves no room for another copy, `has_room` says no and the sequence that
    # needed pages waits on the device instead (Scheduler); only when no sequence at all could run does
    # the scheduler preempt past the budget (with a warning), since nothing would ever free pages."""

    def __init__(
        self, pool: KVPool, slots: StateSlots, lag: int, max_bytes: int, store: HostImageStore | None = None
    ) -> None:
        self.pool, self.slots, self.lag, self.max_bytes, self.store = pool, slots, lag, max_bytes, store
        self.copies: dict[int, HostImage] = {}  # by id(Sequence)
        self.nbytes = 0
        self.preemptions = self.resumes = 0
        # NOTE: the pipeline's driver has every stage repeat these on its own planes (StageMirror)
        self.spill, self.unspill = spill, unspill

    def holds(self, seq: Sequence) -> bool:
        return id(seq) in self.copies

    def copy_bytes(self, seq: Sequence) -> int:
        """Host bytes seq's copy would take: its committed pages' planes and one state slot."""
        return self.pool.pages_for(seq.cache.length) * self.pool.page_bytes + self.slots.slot_nbytes

    def has_room(self, seq: Sequence) -> bool:
        return self.nbytes + self.copy_bytes(seq) <= self.max_bytes

    def swap_out(self, seq: Sequence) -> None:
        """Copy seq's slot and committed pages to host memory and free them (seq.cache becomes None)."""
        cache = seq.cache
        pages = cache.block_table[: self.pool.pages_for(cache.length)]
        self.pool.incref(pages)
        host = self.spill(
            self.pool, SequenceImage(cache.length, self.slots.copy_out(cache.slot), list(pages))
        )
        cache.free()
        seq.cache = None
        self.copies[id(seq)] = host
        self.nbytes += host.nbytes
        self.preemptions += 1
        self._share_budget()
        if self.nbytes > self.max_bytes:
            log.warning(
                "preempted %s past --host-kv-mib (%.0f MiB of preempted sequences in host memory): no "
                "sequence could run otherwise", seq.request_id, self.nbytes / 2**20,
            )  # fmt: skip

    def pages_to_resume(self, seq: Sequence, tokens: int) -> int:
        """Free pages resuming seq with room for `tokens` takes."""
        return max(self.pool.pages_for(tokens), self.copies[id(seq)].n_pages)

    def swap_in(self, seq: Sequence, tokens: int) -> SequenceCache | None:
        """seq's cache back in a fresh slot and fresh pages, reserved for `tokens`; None (nothing taken)
        when no slot or too few pages are free."""
        host = self.copies[id(seq)]
        if self.slots.num_free == 0 or self.pages_to_resume(seq, tokens) > self.pool.num_free:
            return None
        image = self.unspill(self.pool, host, self.pool.device)
        cache = SequenceCache(self.pool, self.slots, lag=self.lag)
        cache.restore(image)
        release_image(self.pool, image)  # the cache holds the pages alone now
        cache.reserve(tokens)
        self.drop(seq)
        self.resumes += 1
        return cache

    def drop(self, seq: Sequence) -> None:
        host = self.copies.pop(id(seq), None)
        if host is not None:
            self.nbytes -= host.nbytes
            self._share_budget()

    def _share_budget(self) -> None:
        """The image store keeps what the preempted copies leave of the budget (dropping LRU images)."""
        if self.store is not None:
            self.store.reserve(self.nbytes)
