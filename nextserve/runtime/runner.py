"""Runs a StepPlan on one device: prefill chunks each as their own forward, decodes as one
row-invariant decode step (a CUDA graph replay where one is captured), then samples the rows that
choose a token."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from ..cache.decode_rows import DecodeRows, fill_block_tables
from ..cache.kv_pool import KVPool
from ..cache.states import StateSlots
from ..engine.sampling import TokenLogprob, sample_row
from ..engine.scheduler import Chunk, StepPlan
from ..model.batch import DecodeBatch, ForwardBatch, SeqChunk
from ..model.flash_next import FlashNext
from ..model.mtp import MTP
from ..ops.triton.common import pdl_mode
from .graph_runner import GraphRunner
from .mtp_runner import MtpDrafter, MtpRows

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
    ) -> None:
        """`mtp`: the MTP block, to chain up to `draft_tokens` drafts after each step (speculative
        method mtp)."""
        self.model, self.device, self.pool, self.states, self.graphs = model, device, pool, states, graphs
        self.pdl = pdl
        self.drafter = None
        if mtp is not None:
            self.drafter = MtpDrafter(model, mtp, states, draft_tokens, self.decode_batch)

    def decode_inputs(self, chunks: list[Chunk]) -> tuple[list[int], list[int], list[int], list[list[int]]]:
        """Host lists of the decode rows: token ids, positions, state slots, block tables."""
        for ch in chunks:
            ch.seq.cache.own_page_at(ch.start)
        return (
            [ch.seq.token_at(ch.start) for ch in chunks],
            [ch.start for ch in chunks],
            [ch.seq.cache.slot for ch in chunks],
            [ch.seq.cache.block_table for ch in chunks],
        )

    def decode_batch(self, ids, positions, slots, tables, width: int | None = None) -> DecodeBatch:
        """An eager DecodeBatch; block tables padded with the scratch page to `width` (default: the
        longest)."""
        table = np.empty((len(tables), width or max(len(t) for t in tables)), dtype=np.int32)
        fill_block_tables(table, tables, self.pool.scratch_page)
        table, dev = torch.from_numpy(table), self.device
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        rows = DecodeRows(self.pool, self.states, slot_t, pos, table.to(dev))
        return DecodeBatch(torch.tensor(ids, dtype=torch.long, device=dev), pos, rows)

    def decode_logits(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, V] of one decode step of `chunks` (one token each, distinct sequences), and their
        argmax [B] when the step computed it (a graph replay does, inside the graph)."""
        ids, positions, slots, tables = self.decode_inputs(chunks)
        if self.graphs is not None and self.graphs.fits(len(chunks)):
            return self.graphs.replay(ids, positions, slots, tables)
        batch = self.decode_batch(ids, positions, slots, tables)
        return self.model.logits(self.model.decode(batch), row_invariant=True), None

    def _batch(self, chunks: list[Chunk], row_invariant: bool) -> ForwardBatch:
        ids, pos, spans = [], [], []
        for ch in chunks:
            ids += ch.seq.tokens(ch.start, ch.end)
            pos += range(ch.start, ch.end)
            spans.append(SeqChunk(ch.seq.cache, ch.start, ch.end - ch.start))
        return ForwardBatch(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(pos, dtype=torch.long, device=self.device),
            spans,
            row_invariant,
        )

    def _prefill(self, ch: Chunk, results: list[ChunkResult]) -> torch.Tensor | None:
        """The streams of a prefill chunk's rows [n, nH], or None after recording the failure.

        # NOTE: a failed forward fails exactly the request in it: each prefill chunk is its own."""
        try:
            return self.model(self._batch([ch], row_invariant=False))
        except Exception as exc:  # noqa: BLE001
            log.exception("prefill forward failed")
            results.append(ChunkResult(ch, error=_describe(exc)))
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
        # NOTE: a prefill chunk runs alone, exactly as in the serial reference; decode rows share
        # one row-invariant forward, so each gets the bits it would get alone (C1).
        for ch in plan.prefills:
            streams = self._prefill(ch, results)
            if streams is None:
                continue
            if self.drafter is not None:
                kept[id(ch)] = streams
            if ch.sample:
                rows.append(streams[-1:])
                sample_chunks.append(ch)
            else:
                results.append(ChunkResult(ch))
        results += [self._verify(ch, kept) for ch in plan.verifies]
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
            ch, seq = r.chunk, r.chunk.seq
            end = ch.end if r.computed is None else r.computed
            sampled = [] if r.token is None else [r.token] + [t for t, _ in r.more]
            # the committed rows' input tokens: known ones, then a window's accepted drafts
            ids = (seq.tokens(ch.start, min(end, seq.num_tokens)) + sampled)[: end - ch.start]
            chain = 0
            if sampled and seq.constraint is None:
                chain = max(0, min(self.drafter.k, seq.token_budget() - end - 1))
            after = sampled[-1] if sampled else None  # the token after the last committed row
            rows = streams[: end - ch.start]
            items.append(MtpRows(seq.cache, ch.start, rows, ids, bool(ch.drafts), after, chain))
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

    def _window(self, ch: Chunk, ids: list[int]) -> ForwardBatch:
        """A verify window's rows: ids at positions ch.start.., one sequence, row-invariant (each row
        gets the bits a decode step at its position gets)."""
        n = len(ids)
        pos = torch.arange(ch.start, ch.start + n, dtype=torch.long, device=self.device)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        return ForwardBatch(ids_t, pos, [SeqChunk(ch.seq.cache, ch.start, n)], row_invariant=True)

    def _verify(self, ch: Chunk, kept: dict[int, torch.Tensor]) -> ChunkResult:
        """One verify window (engine/speculative.py): the sequence's last token and its drafts in one
        forward, rows sampled in order until a sampled token differs from its draft; the state is
        rewound to the last committed position when a draft was rejected. The committed rows' streams
        go to `kept` when the MTP drafts."""
        seq, cache = ch.seq, ch.seq.cache
        ids = [seq.token_at(ch.start), *ch.drafts]
        try:
            for p in range(ch.start, ch.end):
                cache.own_page_at(p)
            before = self.states.copy_out(cache.slot)
            streams = self.model(self._window(ch, ids))  # [1 + k, nH]
            logits = self.model.logits(streams, row_invariant=True)
            sampled = sample_window(logits, ch)
            n_kept = len(sampled)  # rows whose input is committed: the last token, the accepted drafts
            if n_kept < len(ids):
                self.states.copy_in(cache.slot, before)
                self.model(self._window(ch, ids[:n_kept]))
            if self.drafter is not None:
                # NOTE: the re-run's rows equal these bit for bit (row-invariant windows).
                kept[id(ch)] = streams[:n_kept]
        except Exception as exc:  # noqa: BLE001 - that request only (C2)
            log.exception("verify window failed")
            return ChunkResult(ch, error=_describe(exc))
        (token, lp), more = sampled[0], sampled[1:]
        return ChunkResult(ch, token, lp, more=more, computed=ch.start + n_kept)

    def _sample(
        self, chunks: list[Chunk], parts: list[tuple[torch.Tensor, torch.Tensor | None]]
    ) -> list[ChunkResult]:
        """Tokens of the rows of the logits parts [R_i, V] (on the model's device, with their argmax
        when computed already), in order.

        # NOTE: plain greedy rows (no logprobs, no grammar) take their argmax on the device and move
        # one id each; the others move their whole row to the CPU sampler. argmax returns the first
        # maximal index on every device, so both give the same token for the same logits."""
        plain = [i for i, ch in enumerate(chunks) if _plain_greedy(ch)]
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
                token, lp = sample_row(rows[i], ch.seq.params, ch.seq.generator, ch.seq.constraint)
            except Exception as exc:  # noqa: BLE001 - e.g. a broken grammar: that request only
                results.append(ChunkResult(ch, error=_describe(exc)))
                continue
            results.append(ChunkResult(ch, token, lp))
        return results


def sample_window(logits: torch.Tensor, ch: Chunk) -> list[tuple[int, TokenLogprob | None]]:
    """A verify window's rows [1 + k, V] sampled in order with the request's own sampler, up to the
    first sampled token that differs from its draft (kept too: it is the next token), or all of them."""
    seq, sampled = ch.seq, []
    for j in range(logits.shape[0]):
        sampled.append(sample_row(logits[j], seq.params, seq.generator))
        if j == len(ch.drafts) or sampled[-1][0] != ch.drafts[j]:
            break
    return sampled


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts)


def _plain_greedy(ch: Chunk) -> bool:
    p = ch.seq.params
    return p.greedy and p.logprobs is None and ch.seq.constraint is None
