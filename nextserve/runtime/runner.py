"""Runs a StepPlan on one device: prefill chunks each as their own forward, decodes as one
row-invariant forward, then samples the rows that choose a token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.sampling import TokenLogprob, sample_row
from ..engine.scheduler import StepPlan
from ..engine.sequence import Sequence
from ..model.batch import ForwardBatch, SeqChunk
from ..model.flash_next import FlashNext


@dataclass
class Sampled:
    seq: Sequence
    token: int
    logprob: TokenLogprob | None


class ModelRunner:
    def __init__(self, model: FlashNext, device: torch.device) -> None:
        self.model, self.device = model, device

    def _batch(self, chunks, row_invariant: bool) -> ForwardBatch:
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

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[Sampled]:
        rows, sample_chunks = [], []
        # NOTE: a prefill chunk runs alone, exactly as in the serial reference; decode rows share
        # one row-invariant forward, so each gets the bits it would get alone (C1).
        for ch in plan.prefills:
            streams = self.model(self._batch([ch], row_invariant=False))
            if ch.sample:
                rows.append(streams[-1:])
                sample_chunks.append(ch)
        if plan.decodes:
            rows.append(self.model(self._batch(plan.decodes, row_invariant=True)))
            sample_chunks += plan.decodes
        if not rows:
            return []
        logits = self.model.logits(torch.cat(rows), row_invariant=True)
        out = []
        for ch, row in zip(sample_chunks, logits, strict=True):
            token, lp = sample_row(row, ch.seq.params, ch.seq.generator, ch.seq.constraint)
            out.append(Sampled(ch.seq, token, lp))
        return out
