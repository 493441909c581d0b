"""Runs a StepPlan on one device: prefill chunks each as their own forward (consecutive ones of equal
length as one forward that computes each as alone, `FlashNext.forward_chunks`), decodes as one
row-invariant decode step (a CUDA graph replay where one is captured), then samples the rows that
choose a token."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from ..cache.decode_rows import eager_window
from ..cache.kv_pool import KVPool
from ..cache.states import StateSlots
from ..model.batch import ForwardBatch, SeqChunk
from ..model.flash_next import FlashNext
from ..model.mtp import MTP
from ..ops.pdl import pdl_mode
from ..ops.pinned import upload
from ..ops.tokens import greedy_ids
from ..step_plan import Chunk, StepPlan, TokenLogprob
from .graph_runner import GraphRunner
from .mtp_runner import MtpDrafter, MtpRows
from .windows import accept_windows, plain_greedy, window_inputs

log = logging.getLogger("nextserve.runner")


@dataclass
class ChunkResult:
    """What became of one scheduled chunk: computed (and maybe a sampled token), or an error that
    ends its request only."""

    chunk: Chunk
    token: int | None = None
    logprob: TokenLogprob | None = None
    error: str | None = None
    more: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)  # a window's next tokens
    computed: int | None = None  # a window's committed end (chunk.end when all its drafts held)
    drafts: tuple[int, ...] = ()  # the MTP block's drafts for the sequence's next window


@dataclass
class LaunchedStep:
    """A decode step of plain greedy rows launched without waiting for its tokens (async scheduling):
    row b's token arrives in host[b] once `done` has passed (on the CPU at once)."""

    chunks: list[Chunk]
    host: torch.Tensor  # [>= B] int64 (pinned on CUDA)
    done: torch.cuda.Event | None

    def tokens(self) -> list[int]:
        """The rows' tokens (waits for the step)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host[: len(self.chunks)].tolist()


@dataclass(frozen=True)
class CommittedRows:
    """What a step committed of one chunk, as the MTP block takes it (MtpRows without the streams)."""

    start: int  # position of the first committed row
    ids: list[int]  # the committed rows' input tokens
    row_invariant: bool  # a verify window's rows (a prefill chunk's are not)
    sampled: int | None  # the token after the last committed row, when one was sampled
    chain: int  # drafts to chain after it


def committed_rows(r: ChunkResult, k: int) -> CommittedRows:
    """The rows result `r` committed (a window's: up to its computed end) and the chain of at most k
    drafts to follow them (none for a grammar request, none past the request's token budget)."""
    ch, seq = r.chunk, r.chunk.seq
    end = ch.end if r.computed is None else r.computed
    sampled = [] if r.token is None else [r.token] + [t for t, _ in r.more]
    # the committed rows' input tokens: known ones, then a window's accepted drafts
    ids = (seq.tokens(ch.start, min(end, seq.num_tokens)) + sampled)[: end - ch.start]
    chain = 0
    if sampled and seq.constraint is None:
        chain = max(0, min(k, seq.token_budget() - end - 1))
    return CommittedRows(ch.start, ids, bool(ch.drafts), sampled[-1] if sampled else None, chain)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class ModelRunner:
    def __init__(
        self,
        model: FlashNext,
        device: torch.device,
        pool: KVPool,
        states: StateSlots,
        graphs: GraphRunner | None = None,
        pdl: bool = False,
        mtp: MTP | None = None,
        draft_tokens: int = 0,
        max_rows: int = 1,
        embed: torch.Tensor | None = None,
    ) -> None:
        """`mtp`: the MTP block, to chain up to `draft_tokens` drafts after each step (speculative
        method mtp), reading the token embeddings `embed` (default: the model's). `max_rows`: the most
        rows of a step (sequences x rows per window)."""
        self.model, self.device, self.pool, self.states, self.graphs = model, device, pool, states, graphs
        self.pdl = pdl
        self.drafter = None
        if mtp is not None:
            self.drafter = MtpDrafter(model, mtp, states, draft_tokens, pool, embed)
        # NOTE: every decode step's argmax lands in `tokens` (a graph writes all its rows there), which a
        # step launched before the host read them names by row (launch_decode); two host buffers, so the
        # next launched step's copy never lands where the host still reads the previous one's.
        self.tokens = torch.zeros(max_rows, dtype=torch.long, device=device)
        pin = device.type == "cuda"
        self._host_tokens = [torch.zeros(max_rows, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._launches = 0

    def window_inputs(self, chunks: list[Chunk], W: int) -> tuple[np.ndarray, list[list[int]]]:
        """Host inputs of one step of `chunks` W rows each (runtime/windows.py)."""
        return window_inputs(chunks, W, self.states)

    def run_window(
        self, inputs: np.ndarray, tables: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """W steps of B rows (window_inputs): streams [W, B, nH], logits [W, B, V], and their argmax [W, B]
        when the step computed it (a graph replay does, inside the graph; its outputs are overwritten by
        the next replay)."""
        _, W, B = inputs.shape
        if self.graphs is not None and self.graphs.fits(B, W):
            return self.graphs.replay(inputs, tables)
        streams = self.window_streams(inputs, tables)
        logits = self.model.logits(streams, row_invariant=True)
        return streams.view(W, B, -1), logits.view(W, B, -1), None

    def window_streams(
        self, inputs: np.ndarray, tables: list[list[int]], x: torch.Tensor | None = None
    ) -> torch.Tensor:
        """W steps of B rows (window_inputs) run eagerly: streams [W*B, nH] after the model's layers (x
        [W*B, nH]: the previous pipeline stage's). Ids naming the previous step's tokens are resolved from
        self.tokens, as the graphs resolve them."""
        batch = eager_window(self.pool, self.states, inputs, tables, self.device, pending=self.tokens)
        return self.model.window(batch, x)

    def launch_decode(self, chunks: list[Chunk]) -> LaunchedStep:
        """One decode step of plain greedy `chunks`, launched without waiting for its tokens. A chunk's
        last token may still be on the device: the previous launched step's row r, named -(1 + r) by the
        sequence (Sequence.pending)."""
        with pdl_mode(self.pdl), torch.inference_mode():
            B = len(chunks)
            _, logits, top = self.run_window(*self.window_inputs(chunks, 1))
            if top is None:  # run eagerly: the argmax a graph writes into self.tokens
                greedy_ids(logits[0], self.tokens[:B])
            host = self._host_tokens[self._launches % 2]
            self._launches += 1
            host[:B].copy_(self.tokens[:B], non_blocking=True)
            done = None
            if self.device.type == "cuda":
                done = torch.cuda.Event()
                done.record()
        return LaunchedStep(list(chunks), host, done)

    def decode_logits(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, V] of one decode step of `chunks` (one token each, distinct sequences), and their
        argmax [B] when the step computed it (a graph replay does, inside the graph)."""
        _, logits, top = self.run_window(*self.window_inputs(chunks, 1))
        return logits[0], None if top is None else top[0]

    def _batch(self, chunks: list[Chunk], row_invariant: bool) -> ForwardBatch:
        ids, pos, spans = [], [], []
        for ch in chunks:
            ids += ch.seq.tokens(ch.start, ch.end)
            pos += range(ch.start, ch.end)
            spans.append(SeqChunk(ch.seq.cache, ch.start, ch.end - ch.start))
        return ForwardBatch(
            upload(ids, torch.long, self.device),
            upload(pos, torch.long, self.device),
            spans,
            row_invariant,
        )

    def _prefill(self, group: list[Chunk], results: list[ChunkResult]) -> list[torch.Tensor] | None:
        """The streams of each prefill chunk's rows [n, nH] (a group of chunks of equal length runs as one
        forward that computes each as alone), or None after recording the failure.

        # NOTE: a failed forward fails exactly the requests in it: a chunk alone is its own; a group's
        # forward holds its chunks' requests, as a decode step holds its rows'."""
        try:
            if len(group) == 1:
                return [self.model(self._batch(group, row_invariant=False))]
            return self.model.forward_chunks([self._batch([ch], row_invariant=False) for ch in group])
        except Exception as exc:  # noqa: BLE001
            log.exception("prefill forward failed")
            results += [ChunkResult(ch, error=_describe(exc)) for ch in group]
            return None

    def execute(self, plan: StepPlan) -> list[ChunkResult]:
        # NOTE: the PDL switch is process-wide: each step sets this engine's and restores the previous
        # one, so engines of one process (tests, benchmarks) keep their own settings. Captured graphs
        # keep the setting they were captured with (the engine's: LLMEngine captures under it).
        with pdl_mode(self.pdl):
            return self._execute(plan)

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> list[ChunkResult]:
        results: list[ChunkResult] = []
        rows, sample_chunks = [], []
        kept: dict[int, torch.Tensor] = {}  # id(chunk) -> streams of its committed rows, for the MTP
        # NOTE: a prefill chunk runs alone, exactly as in the serial reference, or in a group whose
        # forward computes each chunk as alone; decode rows share one row-invariant forward, so each gets
        # the bits it would get alone (C1).
        for group in prefill_groups(plan.prefills):
            outs = self._prefill(group, results)
            if outs is None:
                continue
            for ch, streams in zip(group, outs, strict=True):
                if self.drafter is not None:
                    kept[id(ch)] = streams
                if ch.sample:
                    rows.append(streams[-1:])
                    sample_chunks.append(ch)
                else:
                    results.append(ChunkResult(ch))
        if plan.verifies:
            results += self._verify(plan.verifies, kept)
        logits: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (logits, argmax or None) parts
        if rows:
            try:
                logits.append((self.model.logits(torch.cat(rows), row_invariant=True), None))
            except Exception as exc:  # noqa: BLE001
                log.exception("logits failed")
                results += [ChunkResult(ch, error=_describe(exc)) for ch in sample_chunks]
                sample_chunks = []
        if plan.decodes:
            try:
                logits.append(self.decode_logits(plan.decodes))
                sample_chunks += plan.decodes
            except Exception as exc:  # noqa: BLE001
                log.exception("decode step failed")
                results += [ChunkResult(ch, error=_describe(exc)) for ch in plan.decodes]
        if sample_chunks:
            results += self._sample(sample_chunks, logits)
        if kept:
            self._draft(results, kept)
        return results

    def _draft(self, results: list[ChunkResult], kept: dict[int, torch.Tensor]) -> None:
        """The MTP rows of every committed chunk whose streams were kept, and the drafts of the sampling
        sequences without a grammar (into their results). Drafts never change an output, so an MTP
        failure only loses them (logged)."""
        items, owners = [], []
        for r in results:
            streams = kept.get(id(r.chunk))
            if r.error is not None or streams is None:
                continue
            c = committed_rows(r, self.drafter.k)
            rows, cache = streams[: len(c.ids)], r.chunk.seq.cache
            items.append(MtpRows(cache, c.start, rows, c.ids, c.row_invariant, c.sampled, c.chain))
            owners.append(r)
        if not items:
            return
        try:
            drafts = self.drafter.run(items)
        except Exception:  # noqa: BLE001 - drafts are a speed-up: their loss changes no output (C1)
            log.exception("MTP drafting failed")
            return
        for r, d in zip(owners, drafts, strict=True):
            r.drafts = d

    def execute_verifies(self, chunks: list[Chunk]) -> list[ChunkResult]:
        """Verify windows of `chunks` alone, as a step runs them (tests)."""
        with pdl_mode(self.pdl), torch.inference_mode():
            return self._verify(chunks, {})

    def _verify(self, chunks: list[Chunk], kept: dict[int, torch.Tensor]) -> list[ChunkResult]:
        """The step's verify windows (engine/speculative.py) in one forward of W steps: each window's rows
        sampled in order until a sampled token differs from its draft; a window with a rejected draft is
        rewound to the state its last committed row kept. The committed rows' streams go to `kept` when
        the MTP drafts.

        # NOTE: the rewound state is the one a serial decode of the committed rows leaves, bit for bit:
        # the window's step j is decode step j (WindowBatch), and a keep slot holds the state after it."""
        W = 1 + max(len(ch.drafts) for ch in chunks)
        try:
            streams, logits, top = self.run_window(*self.window_inputs(chunks, W))
        except Exception as exc:  # noqa: BLE001 - those requests only (C2)
            log.exception("verify windows failed")
            return [ChunkResult(ch, error=_describe(exc)) for ch in chunks]
        return self.resolve_windows(chunks, logits, top, streams, kept)

    def resolve_windows(
        self,
        chunks: list[Chunk],
        logits: torch.Tensor,
        top: torch.Tensor | None,
        streams: torch.Tensor | None = None,
        kept: dict[int, torch.Tensor] | None = None,
    ) -> list[ChunkResult]:
        """The results of verify windows from their rows' logits [W, B, V] (and argmax [W, B] when
        computed): each window sampled (`accept_windows`), the slots of windows with a rejected draft
        rewound to the keep slot of their last committed row, the committed rows' streams [W, B, nH] to
        `kept` when the MTP drafts."""
        try:
            sampled = accept_windows(chunks, logits, top)
        except Exception as exc:  # noqa: BLE001 - those requests only (C2)
            log.exception("sampling verify windows failed")
            return [ChunkResult(ch, error=_describe(exc)) for ch in chunks]
        results, kept_slots, slots = [], [], []
        for b, (ch, rows) in enumerate(zip(chunks, sampled, strict=True)):
            if isinstance(rows, Exception):  # that request's sampler failed
                results.append(ChunkResult(ch, error=_describe(rows)))
                continue
            n_kept = len(rows)  # rows whose input is committed: the last token, the accepted drafts
            if n_kept <= len(ch.drafts):
                kept_slots.append(self.states.keep_slot(ch.seq.cache.slot, n_kept - 1))
                slots.append(ch.seq.cache.slot)
            if self.drafter is not None:
                kept[id(ch)] = streams[:n_kept, b].clone()
            (token, lp), more = rows[0], rows[1:]
            results.append(ChunkResult(ch, token, lp, more=more, computed=ch.start + n_kept))
        self.states.rewind(kept_slots, slots)  # with pipeline stages: mirrored to every stage
        return results

    def _sample(
        self, chunks: list[Chunk], parts: list[tuple[torch.Tensor, torch.Tensor | None]]
    ) -> list[ChunkResult]:
        """Tokens of the rows of the logits parts [R_i, V] (on the model's device, with their argmax
        when computed already), in order.

        # NOTE: plain greedy rows (no logprobs, no grammar) take their argmax on the device and move
        # one id each; the others move their whole row to the CPU sampler. argmax returns the first
        # maximal index on every device, so both give the same token for the same logits."""
        plain = [i for i, ch in enumerate(chunks) if plain_greedy(ch)]
        rest = [i for i in range(len(chunks)) if i not in set(plain)]
        tokens, rows = {}, {}
        if plain:
            ids = _cat([am if am is not None else lg.argmax(dim=-1) for lg, am in parts])
            ids = ids if len(plain) == len(chunks) else ids[plain]
            tokens = dict(zip(plain, ids.tolist(), strict=True))
        if rest:
            rows = dict(zip(rest, _cat([lg for lg, _ in parts])[rest].float().cpu(), strict=True))
        results = []
        for i, ch in enumerate(chunks):
            if i in tokens:
                results.append(ChunkResult(ch, tokens[i]))
                continue
            try:
                token, lp = ch.seq.sample(rows[i])
            except Exception as exc:  # noqa: BLE001 - e.g. a broken grammar: that request only
                results.append(ChunkResult(ch, error=_describe(exc)))
                continue
            results.append(ChunkResult(ch, token, lp))
        return results


def prefill_groups(chunks: list[Chunk]) -> list[list[Chunk]]:
    """The step's prefill chunks as forwards, in plan order: each run of consecutive chunks of equal length
    is one group (their routed experts then take one chunk's blocks: ops.moe.experts_of_chunks); a
    sequence's chunks stay in order, since groups never reorder the plan."""
    groups: list[list[Chunk]] = []
    for ch in chunks:
        if groups and groups[-1][0].end - groups[-1][0].start == ch.end - ch.start:
            groups[-1].append(ch)
        else:
            groups.append([ch])
    return groups


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts)
