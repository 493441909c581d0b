"""Decode groups for pipeline stages (`--decode-groups G`): one step's decode rows split into G round-robin
groups that circulate through the stages, each group sampled by stage 0 and sent in again for its next
token as soon as its logits are back, for up to G rounds a step. While one group is in a later stage the
next one is in an earlier stage, so every stage works (DESIGN.md "Pipeline").

# NOTE: why the outputs do not change (C1): every decode row is computed row-invariantly, so a row's bits
# do not depend on which rows share its group; a row's rounds are its serial decode steps, one token each
# at consecutive positions, sampled in order with the request's own sampler and generator. A row stops
# early at its limit (max_tokens, max_context: admission reserved the pages of every position it may
# reach), at an end-of-sequence or stop token, or on an error; grammar-constrained rows take one round,
# since their grammar advances as the engine appends. Stop strings are found by the engine, which drops
# what follows them, as after a verify window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..step_plan import Chunk, TokenLogprob
from .runner import ChunkResult


@dataclass
class DecodeRow:
    chunk: Chunk
    limit: int  # rounds this step may run for the row
    sampled: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)
    error: str | None = None
    done: bool = False

    @property
    def position(self) -> int:
        """The position of the row's next input token."""
        return self.chunk.start + len(self.sampled)

    @property
    def token(self) -> int:
        """The row's next input token: the sequence's last, then each sampled one."""
        return self.sampled[-1][0] if self.sampled else self.chunk.seq.token_at(self.chunk.start)


def round_limit(chunk: Chunk, rounds: int) -> int:
    """How many tokens a decode row may take this step: up to `rounds`, never past what ends the request
    by length; one for a grammar-constrained request."""
    seq = chunk.seq
    if seq.constraint is not None:
        return 1
    return max(1, min(rounds, seq.token_budget() - seq.num_tokens))


class DecodeRounds:
    """The rows of one step's decode groups, what each has sampled, and when each is done."""

    def __init__(self, chunks: list[Chunk], groups: int, eos: int) -> None:
        self.eos = eos
        split = [chunks[g::groups] for g in range(groups)]
        self.groups = [[DecodeRow(ch, round_limit(ch, groups)) for ch in grp] for grp in split if grp]

    def record(self, rows: list[DecodeRow], results: list[ChunkResult]) -> None:
        """One round's sampled tokens (or errors) of `rows`, in order."""
        for row, r in zip(rows, results, strict=True):
            if r.error is not None:
                row.error, row.done = r.error, True
                continue
            row.sampled.append((r.token, r.logprob))
            p = row.chunk.seq.params
            stop = r.token in p.stop_token_ids or (r.token == self.eos and not p.ignore_eos)
            row.done = stop or len(row.sampled) >= row.limit

    def fail(self, rows: list[DecodeRow], error: str) -> None:
        for row in rows:
            row.error, row.done = error, True

    @staticmethod
    def active(rows: list[DecodeRow]) -> list[DecodeRow]:
        return [r for r in rows if not r.done]

    def results(self) -> list[ChunkResult]:
        out = []
        for row in (r for grp in self.groups for r in grp):
            if row.error is not None:
                out.append(ChunkResult(row.chunk, error=row.error))
                continue
            (token, lp), more = row.sampled[0], row.sampled[1:]
            out.append(ChunkResult(row.chunk, token, lp, more=more, computed=row.position))
        return out
