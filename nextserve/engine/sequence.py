"""A request as the engine tracks it: its tokens, where its state is, and how it ends."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..cache.sequence import SequenceCache
from .detokenizer import Detokenizer
from .penalties import TokenTally
from .sampling import SamplingParams, TokenConstraint, TokenLogprob, sample_row


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: a request is itself, whatever its tokens
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_context: int
    prompt_text: str | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    cache: SequenceCache | None = None
    num_computed: int = 0  # tokens whose KV and state are committed
    num_cached_prompt: int = 0  # prompt tokens resumed from an image instead of computed
    generator: torch.Generator | None = None
    text: str = ""
    constraint: TokenConstraint | None = None
    detokenizer: Detokenizer | None = None
    image_points: frozenset[int] = frozenset()  # prompt positions to keep prefix images at
    drafts: tuple[int, ...] = ()  # the MTP block's drafts after the last token (engine/speculative.py)
    # rows of launched decode steps whose tokens follow output_ids but are still on the device
    # (async scheduling, engine/engine.py): the token at num_tokens + i is the i-th one's
    pending: list[int] = field(default_factory=list)
    num_emitted: int = 0  # output tokens handed out as deltas (LLMEngine.step(deltas=True))
    tally: TokenTally | None = None  # the history penalties read (params.penalized only)
    arrival: int = 0  # order of arrival (Scheduler.add): preemption takes the latest first
    salt: bytes = b""  # the tenant's cache salt: prefix images are shared only under the same salt

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, position: int) -> int:
        """The token at `position` (prompt, then output) without building all_ids: a decode step
        reads one token per row, and all_ids costs O(context) per call."""
        n = len(self.prompt_ids)
        if position < n:
            return self.prompt_ids[position]
        i = position - n
        if i < len(self.output_ids):
            return self.output_ids[i]
        return -1 - self.pending[i - len(self.output_ids)]  # named by its row (ops/tokens.py)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens start .. end-1 (a prefill chunk) without copying the whole context."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:n] + self.output_ids[max(0, start - n) : end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token: int, logprob: TokenLogprob | None, eos: int | None) -> str | None:
        """Add a sampled token (its logprob, the grammar's step, the text); the finish reason it brings:
        "stop" (a stop token, eos unless ignored, the grammar's end, a stop string: the text is cut
        before it), "length" (max_tokens or max_context), or None."""
        self.output_ids.append(token)
        if self.tally is not None:
            self.tally.add(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        p = self.params
        stopped = token in p.stop_token_ids or (token == eos and not p.ignore_eos)
        if self.constraint is not None:
            self.constraint.accept(token)
        if self.detokenizer is not None and not stopped:
            self.text = self.detokenizer.add(token)
        if stopped or (self.constraint is not None and self.constraint.is_terminated()):
            return "stop"
        if p.stop and any(s in self.text for s in p.stop):
            self.text = self.text[: min(self.text.find(s) for s in p.stop if s in self.text)]
            return "stop"
        if (
            p.max_tokens is not None and len(self.output_ids) >= p.max_tokens
        ) or self.num_tokens >= self.max_context:
            return "length"
        return None

    def sample(self, logits: torch.Tensor, extra: tuple[int, ...] = ()) -> tuple[int, TokenLogprob | None]:
        """The next token as this request's own sampler picks it from a row of logits [V] that follows its
        tokens and then `extra` (a verify window's earlier drafts)."""
        return sample_row(logits, self.params, self.generator, self.constraint, self.tally, extra)

    def token_budget(self) -> int:
        """Most tokens (prompt + output) this sequence can ever hold (its pages are taken as it grows)."""
        cap = self.max_context
        if self.params.max_tokens is not None:
            cap = min(cap, len(self.prompt_ids) + self.params.max_tokens)
        return cap
