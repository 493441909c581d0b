"""What one engine step runs (the scheduler's plan) and the logprobs it gives back: the types the engine
(engine/) and the runners (runtime/) both use, so that runtime/ needs nothing of engine/.

# NOTE: a Chunk names its sequence (engine/sequence.Sequence); the runners read only its tokens, cache,
# params and sampler through it, never the scheduler's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine.sequence import Sequence


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Chunk:
    seq: Sequence
    start: int
    end: int
    sample: bool  # the last row's logits choose the next token
    drafts: tuple[int, ...] = ()  # a verify window: the draft tokens after the sequence's last token
    # --pipeline-windows: the window after this one should all of it hold (the token guessed to follow
    # the last draft, then its drafts), run by the front stages while the last stage verifies this one
    guess: tuple[int, ...] = ()


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
