"""Who runs next: admission under the slot and page limits, prefill chunks between decode steps (one a
step, or --prefill-batch-chunks in one forward; with pipeline stages, one per stage), all decoding
sequences together; pages taken as sequences grow, and preemption to host memory when they run short."""

from __future__ import annotations

from collections import deque

from ..cache.kv_pool import KVPool
from ..cache.prefix import PrefixCache
from ..cache.sequence import SequenceCache
from ..cache.states import StateSlots
from ..step_plan import Chunk, StepPlan
from .preemption import Swapper
from .sequence import Sequence, Status
from .speculative import Proposer


class QueueFull(RuntimeError):
    """The bounded waiting queue is full; the server answers 429/503 with this reason."""


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
        swapper: Swapper | None = None,
        lookahead: int = 1,
        prefill_chunks: int = 1,
        guess_windows: bool = False,
        prefill_chunks_beside_decodes: int | None = None,
    ) -> None:
        """`prefill_chunks`: prompt chunks a step runs at most (one process: in one forward, each computed
        as alone; pipeline stages run a step's items one after another, each passed on as soon as it is
        done). `kv_lag`:
        positions before a sequence's committed end that it still writes (SequenceCache.lag; 1 with MTP
        drafting). `lookahead`: positions past a decode chunk's end that the step may write (a verify
        window's drafts, the MTP block's chain, pipeline decode rounds, a guessed window), reserved with
        it. `guess_windows`: a sequence decoding alone also gets the guess of its next window
        (--pipeline-windows: `_guess`). `prefill_chunks_beside_decodes`: prompt chunks a step runs at most
        while it also decodes (None: `prefill_chunks`)."""
        self.pool, self.slots, self.prefix, self.proposer, self.kv_lag = pool, slots, prefix, proposer, kv_lag
        self.prefill_chunk, self.max_pending, self.lookahead = prefill_chunk, max_pending, lookahead
        self.prefill_chunks, self.guess_windows = prefill_chunks, guess_windows
        beside = prefill_chunks_beside_decodes
        self.beside_decodes = prefill_chunks if beside is None else min(beside, prefill_chunks)
        self.swapper = swapper or Swapper(pool, slots, kv_lag, max_bytes=1 << 62)
        self.margin = pool.page_size  # decode room admission reserves past the prompt
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._arrivals = 0

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_pending:
            raise QueueFull(f"{len(self.waiting)} requests already wait (--max-pending {self.max_pending})")
        seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        self.waiting.append(seq)

    def _admit(self) -> None:
        # NOTE: admission reserves the prompt and a margin (`_admission_tokens`); decode takes pages as
        # the sequence grows (`_grow`), preempting to host memory when the pool runs short, so agent
        # requests without max_tokens do not each hold a whole context. A new sequence is admitted only
        # with a page left for every running one that may still grow. First come first served (preempted
        # sequences first, in arrival order): a head that does not fit blocks the ones behind it.
        while self.waiting and self.slots.num_free > 0:
            seq = self.waiting[0]
            tokens = self._admission_tokens(seq)
            resumed = self.swapper.holds(seq)
            if resumed:
                need = self.swapper.pages_to_resume(seq, tokens)
                cache = self.swapper.swap_in(seq, tokens) if self._room(need) else None
            else:
                cache = self._cache_for(seq, tokens)
            if cache is None:
                break
            self.waiting.popleft()
            if not resumed:
                seq.num_computed = seq.num_cached_prompt = cache.length
            seq.cache = cache
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _admission_tokens(self, seq: Sequence) -> int:
        return min(seq.token_budget(), max(len(seq.prompt_ids), seq.num_computed) + self.margin)

    def _growing(self) -> int:
        """Running sequences that may still take a page (their budget beyond their pages)."""
        pages_for = self.pool.pages_for
        return sum(pages_for(s.token_budget()) > len(s.cache.block_table) for s in self.running)

    def _room(self, pages: int) -> bool:
        """Whether `pages` can be taken leaving one for each growing running sequence (dropping prefix
        images that free pages for it)."""
        while pages + self._growing() > self.pool.num_free:
            if self.prefix is None or not self.prefix.evict_one():
                return False
        return True

    def _cache_for(self, seq: Sequence, tokens: int) -> SequenceCache | None:
        """A cache reserved for `tokens`, resumed from the longest stored prefix image; None (nothing
        taken) when the pool cannot hold it even after dropping unused images."""
        image = self.prefix.lookup(seq.prompt_ids, seq.salt) if self.prefix is not None else None
        cache = SequenceCache(self.pool, self.slots, lag=self.kv_lag)
        if image is not None:
            cache.restore(image)
        while cache.pages_needed(tokens) + self._growing() > self.pool.num_free:
            if self.prefix is None or not self.prefix.evict_one(keep=image):
                cache.free()
                return None
        cache.reserve(tokens)
        return cache

    def schedule(self) -> StepPlan:
        """The next step: every running sequence's decode token (or verify window) first, then prompt
        chunks, fewer of them in a step that decodes (`prefill_chunks_beside_decodes`).

        # NOTE: decodes first, so a long prompt arriving beside running decodes holds each of their steps
        # for `prefill_chunks_beside_decodes` chunks, not a whole forward of `prefill_chunks`: a prompt's
        # chunks compute the same bits however many run in a step (C1), only its TTFT grows."""
        self._admit()
        plan = StepPlan()
        stalled: list[Chunk] = []
        prefilling = []
        for seq in list(self.running):
            if seq.cache is None:  # preempted while this plan was made
                continue
            if seq.in_prefill:
                prefilling.append(seq)
                continue
            if seq.num_computed >= seq.token_budget() - 1:
                # NOTE: only with async scheduling: its last token is still on the device (pending) and
                # ends it by length; a sequence whose tokens are all read ends before this
                continue
            start = seq.num_computed
            drafts = self._drafts(seq)
            chunk = Chunk(seq, start, start + 1 + len(drafts), sample=True, drafts=drafts)
            grown = self._grow(chunk, plan)
            if grown is None:
                stalled.append(chunk)
            elif grown:
                (plan.verifies if drafts else plan.decodes).append(chunk)
        limit = self.beside_decodes if plan.decodes or plan.verifies else self.prefill_chunks
        for seq in prefilling:
            if seq.cache is not None:  # (not preempted for a decode's pages)
                self._prefill_chunks(seq, plan, limit)
        if stalled and plan.empty:
            # NOTE: nothing else can run, so nothing would ever free pages: preempt past the host budget
            chunk = stalled[0]
            if self._grow(chunk, plan, over_budget=True):
                (plan.verifies if chunk.drafts else plan.decodes).append(chunk)
        if self.guess_windows:
            self._guess(plan)
        return plan

    def _guess(self, plan: StepPlan) -> None:
        """The guessed next window of a sequence verifying a full window alone (nothing else running):
        the proposer's tokens after its drafts, kept below its token budget. Any guess is safe: it runs
        only once the whole window before it held, and its rows are verified like any window's (C1)."""
        if len(plan.verifies) != 1 or plan.prefills or plan.decodes or len(self.running) != 1:
            return
        ch = plan.verifies[0]
        if len(ch.drafts) == self.proposer.k:  # (the limit is the drafts' and the guess's together)
            ch.guess = tuple(self.proposer.guess(ch.seq, _draft_limit(ch.seq)))

    def _prefill_chunks(self, seq: Sequence, plan: StepPlan, limit: int) -> None:
        """Add seq's next prompt chunks to the plan, up to `limit` a step in all.

        # NOTE: chunks lie on the grid of multiples of prefill_chunk from position 0 (C1). With several
        # a step (one process: one forward computing each as alone; pipeline stages: chunk i + 1 runs on
        # stage 0 while chunk i is on stage 1, each stage running its items in order), a sequence's run of
        # chunks stops at its first image point, since an image is the state a step leaves
        # (engine._keep_image snapshots after the step)."""
        start, n = seq.num_computed, len(seq.prompt_ids)
        while len(plan.prefills) < limit and start < n:
            end = min((start // self.prefill_chunk + 1) * self.prefill_chunk, n)
            plan.prefills.append(Chunk(seq, start, end, sample=end == n))
            if end in seq.image_points:
                break
            start = end

    def _grow(self, chunk: Chunk, plan: StepPlan, over_budget: bool = False) -> bool | None:
        """Reserve the pages chunk's step may write: True when they are, False when chunk's sequence was
        preempted for them, None when it waits on the device (the host budget holds no more copies).

        # NOTE: the pool short, unused prefix images go first, then the running sequence that arrived
        # last (the chunk's own, when it is that one) moves to host memory (`Swapper`)."""
        seq = chunk.seq
        tokens = min(seq.token_budget(), chunk.end + self.lookahead)
        while seq.cache.pages_needed(tokens) > self.pool.num_free:
            if self.prefix is not None and self.prefix.evict_one():
                continue
            victim = max(self.running, key=lambda s: s.arrival)
            if not over_budget and not self.swapper.has_room(victim):
                return None
            self.preempt(victim, plan)
            if victim is seq:
                return False
        seq.cache.reserve(tokens)
        return True

    def preempt(self, seq: Sequence, plan: StepPlan | None = None) -> None:
        """Move a running sequence to host memory and queue it ahead of new prompts (arrival order)."""
        if plan is not None:
            for chunks in (plan.prefills, plan.decodes, plan.verifies):
                chunks[:] = [ch for ch in chunks if ch.seq is not seq]
        self.running.remove(seq)
        self.swapper.swap_out(seq)
        seq.status = Status.WAITING
        at = 0
        queue = self.waiting
        while at < len(queue) and self.swapper.holds(queue[at]) and queue[at].arrival < seq.arrival:
            at += 1
        self.waiting.insert(at, seq)

    def _drafts(self, seq: Sequence) -> tuple[int, ...]:
        """Draft tokens for seq's next verify window: none without a proposer, for a request with a
        grammar (its matcher advances one token at a time), or when the proposer has none. The window's
        positions stay below seq.token_budget() (`_grow` reserves its pages)."""
        if self.proposer is None or seq.constraint is not None:
            return ()
        return tuple(self.proposer.drafts(seq, _draft_limit(seq)))

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End a sequence wherever it is and return its pages and slot at once."""
        if seq.finished:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.swapper.drop(seq)
        if seq.cache is not None:
            seq.cache.free()
            seq.cache = None
        seq.status, seq.finish_reason, seq.error = Status.FINISHED, reason, error

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


def _draft_limit(seq: Sequence) -> int:
    """Most tokens a verify window may propose after seq's last token: its positions stay below the
    sequence's token budget (whose pages `_grow` reserves)."""
    return seq.token_budget() - seq.num_computed - 1
