"""Who runs next: admission under the slot and page limits, one prefill chunk per step between
decode steps, all decoding sequences together."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..cache.kv_pool import KVPool
from ..cache.prefix import PrefixCache
from ..cache.sequence import SequenceCache
from ..cache.states import StateSlots
from .sequence import Sequence, Status
from .speculative import Proposer


class QueueFull(RuntimeError):
    """The bounded waiting queue is full; the server answers 429/503 with this reason."""


@dataclass
class Chunk:
    seq: Sequence
    start: int
    end: int
    sample: bool  # the last row's logits choose the next token
    drafts: tuple[int, ...] = ()  # a verify window: the draft tokens after the sequence's last token


@dataclass
class StepPlan:
    prefills: list[Chunk] = field(default_factory=list)
    decodes: list[Chunk] = field(default_factory=list)
    verifies: list[Chunk] = field(default_factory=list)  # decoding sequences with drafts to check

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes and not self.verifies

    @property
    def chunks(self) -> list[Chunk]:
        return self.prefills + self.decodes + self.verifies

    def running(self) -> StepPlan:
        """This plan without the chunks of sequences that finished since it was made."""

        def keep(chunks: list[Chunk]) -> list[Chunk]:
            return [ch for ch in chunks if not ch.seq.finished]

        return StepPlan(keep(self.prefills), keep(self.decodes), keep(self.verifies))


class Scheduler:
    def __init__(
        self,
        pool: KVPool,
        slots: StateSlots,
        prefill_chunk: int,
        max_pending: int,
        prefix: PrefixCache | None = None,
        proposer: Proposer | None = None,
        kv_lag: int = 0,
    ) -> None:
        """`kv_lag`: positions before a sequence's committed end that it still writes (SequenceCache.lag;
        1 with MTP drafting)."""
        self.pool, self.slots, self.prefix, self.proposer, self.kv_lag = pool, slots, prefix, proposer, kv_lag
        self.prefill_chunk, self.max_pending = prefill_chunk, max_pending
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_pending:
            raise QueueFull(f"{len(self.waiting)} requests already wait (--max-pending {self.max_pending})")
        self.waiting.append(seq)

    def _admit(self) -> None:
        # NOTE: admission reserves every page the sequence may ever need (prompt + max_tokens, capped
        # by max_context), so no other request can cut it short and no preemption is needed (C2).
        # First come first served: a head that does not fit blocks the ones behind it.
        while self.waiting and self.slots.num_free > 0:
            seq = self.waiting[0]
            cache = self._cache_for(seq)
            if cache is None:
                break
            self.waiting.popleft()
            seq.cache = cache
            seq.num_computed = seq.num_cached_prompt = cache.length
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _cache_for(self, seq: Sequence) -> SequenceCache | None:
        """A cache holding every page seq may need, resumed from the longest stored prefix image;
        None (nothing taken) when the pool cannot hold it even after dropping unused images."""
        image = self.prefix.lookup(seq.prompt_ids) if self.prefix is not None else None
        cache = SequenceCache(self.pool, self.slots, lag=self.kv_lag)
        if image is not None:
            cache.restore(image)
        budget = seq.token_budget()
        while cache.pages_needed(budget) > self.pool.num_free:
            if self.prefix is None or not self.prefix.evict_one(keep=image):
                cache.free()
                return None
        cache.reserve(budget)
        return cache

    def schedule(self) -> StepPlan:
        self._admit()
        plan = StepPlan()
        for seq in self.running:
            if seq.in_prefill:
                if not plan.prefills:
                    # NOTE: chunks lie on the grid of multiples of prefill_chunk from position 0 (C1).
                    start = seq.num_computed
                    end = min((start // self.prefill_chunk + 1) * self.prefill_chunk, len(seq.prompt_ids))
                    plan.prefills.append(Chunk(seq, start, end, sample=end == len(seq.prompt_ids)))
            elif seq.num_computed >= seq.token_budget() - 1:
                # NOTE: only with async scheduling: its last token is still on the device (pending) and
                # ends it by length; a sequence whose tokens are all read ends before this
                continue
            elif drafts := self._drafts(seq):
                start = seq.num_computed
                plan.verifies.append(Chunk(seq, start, start + 1 + len(drafts), sample=True, drafts=drafts))
            else:
                plan.decodes.append(Chunk(seq, seq.num_computed, seq.num_computed + 1, sample=True))
        return plan

    def _drafts(self, seq: Sequence) -> tuple[int, ...]:
        """Draft tokens for seq's next verify window: none without a proposer, for a request with a
        grammar (its matcher advances one token at a time), or when the proposer has none. The window's
        positions stay inside the pages admission reserved (seq.token_budget())."""
        if self.proposer is None or seq.constraint is not None:
            return ()
        limit = seq.token_budget() - seq.num_computed - 1
        return tuple(self.proposer.drafts(seq, limit))

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End a sequence wherever it is and return its pages and slot at once."""
        if seq.finished:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq.cache is not None:
            seq.cache.free()
            seq.cache = None
        seq.status, seq.finish_reason, seq.error = Status.FINISHED, reason, error

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
