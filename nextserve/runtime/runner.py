"""Runs a StepPlan on one device: prefill chunks each as their own forward, decodes as one
row-invariant forward, then samples the rows that choose a token."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..engine.sampling import TokenLogprob, sample_row
from ..engine.scheduler import Chunk, StepPlan
from ..model.batch import ForwardBatch, SeqChunk
from ..model.flash_next import FlashNext

log = logging.getLogger("nextserve.runner")


@dataclass
class ChunkResult:
    """What became of one scheduled chunk: computed (and maybe a sampled token), or an error that
    ends its request only."""

    chunk: Chunk
    token: int | None = None
    logprob: TokenLogprob | None = None
    error: str | None = None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class ModelRunner:
    def __init__(self, model: FlashNext, device: torch.device) -> None:
        self.model, self.device = model, device

    def _batch(self, chunks: list[Chunk], row_invariant: bool) -> ForwardBatch:
        ids, pos, spans = [], [], []
        for ch in chunks:
            ids += ch.seq.all_ids[ch.start : ch.end]
            pos += range(ch.start, ch.end)
            spans.append(SeqChunk(ch.seq.cache, ch.start, ch.end - ch.start))
        return ForwardBatch(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(pos, dtype=torch.long, device=self.device),
            spans,
            row_invariant,
        )

    def _forward(self, chunks: list[Chunk], row_invariant: bool, results: list[ChunkResult]):
        """Streams of the chunks' last rows to sample from, or None after recording the failure.

        # NOTE: a failed forward fails exactly the requests in it: each prefill chunk is its own."""
        try:
            streams = self.model(self._batch(chunks, row_invariant))
        except Exception as exc:  # noqa: BLE001
            log.exception("forward failed")
            results += [ChunkResult(ch, error=_describe(exc)) for ch in chunks]
            return None
        if row_invariant:
            return streams
        return streams[-1:]

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[ChunkResult]:
        results: list[ChunkResult] = []
        rows, sample_chunks = [], []
        # NOTE: a prefill chunk runs alone, exactly as in the serial reference; decode rows share
        # one row-invariant forward, so each gets the bits it would get alone (C1).
        for ch in plan.prefills:
            last = self._forward([ch], False, results)
            if last is None:
                continue
            if ch.sample:
                rows.append(last)
                sample_chunks.append(ch)
            else:
                results.append(ChunkResult(ch))
        if plan.decodes:
            streams = self._forward(plan.decodes, True, results)
            if streams is not None:
                rows.append(streams)
                sample_chunks += plan.decodes
        if not rows:
            return results
        try:
            logits = self.model.logits(torch.cat(rows), row_invariant=True)
        except Exception as exc:  # noqa: BLE001
            log.exception("logits failed")
            return results + [ChunkResult(ch, error=_describe(exc)) for ch in sample_chunks]
        for ch, row in zip(sample_chunks, logits, strict=True):
            try:
                token, lp = sample_row(row, ch.seq.params, ch.seq.generator, ch.seq.constraint)
            except Exception as exc:  # noqa: BLE001 - e.g. a broken grammar: that request only
                results.append(ChunkResult(ch, error=_describe(exc)))
                continue
            results.append(ChunkResult(ch, token, lp))
        return results
