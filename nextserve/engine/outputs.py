"""What a request gives back."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling import TokenLogprob


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
