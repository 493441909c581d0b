"""What a request gives back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sampling import TokenLogprob

if TYPE_CHECKING:
    from .sequence import Sequence


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    cached_tokens: int = 0
    error: str | None = None
    offset: int = 0  # where token_ids and logprobs start in the whole output (0: the whole output)

    @classmethod
    def of(cls, seq: Sequence, since: int = 0) -> RequestOutput:
        """A sequence's output so far (a copy: the sequence goes on), or its tokens from `since` on (a
        delta; `text` is always the whole text, which costs nothing to hand over: strings are immutable)."""
        return cls(
            request_id=seq.request_id,
            prompt=seq.prompt_text,
            prompt_token_ids=seq.prompt_ids,
            token_ids=seq.output_ids[since:],
            text=seq.text,
            finish_reason=seq.finish_reason,
            logprobs=seq.logprobs[since:] if seq.params.logprobs is not None else None,
            finished=seq.finished,
            cached_tokens=seq.num_cached_prompt,
            error=seq.error,
            offset=since,
        )
