"""SamplingParams and the sampler: temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: until the sequence reaches max_context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None
    stop: tuple[str, ...] | list | str | None = ()  # strings; token ids given here move to stop_token_ids
    stop_token_ids: tuple[int, ...] | list | None = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n alternatives per generated token (0: the chosen one only)

    def __post_init__(self) -> None:
        stop = [self.stop] if isinstance(self.stop, str | int) else list(self.stop or [])
        ids = [s for s in stop if isinstance(s, int) and not isinstance(s, bool)]
        strs = [s for s in stop if isinstance(s, str)]
        if len(ids) + len(strs) != len(stop):
            raise ValueError("stop must hold strings or token ids")
        object.__setattr__(self, "stop", tuple(strs))
        object.__setattr__(self, "stop_token_ids", tuple(ids) + tuple(self.stop_token_ids or ()))
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop token ids must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] float32 (already divided by temperature) -> logits with the dropped tokens at -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # NOTE: keep the smallest prefix whose mass reaches top_p (the crossing token included).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


class TokenConstraint(Protocol):
    """A per-request grammar (JSON schema, regex...): which tokens may come next."""

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        """Bool mask [vocab_size] of allowed next tokens, or None for no restriction."""
        ...

    def accept(self, token_id: int) -> None: ...

    def is_terminated(self) -> bool: ...


def sample_row(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    constraint: TokenConstraint | None = None,
) -> tuple[int, TokenLogprob | None]:
    """One row of logits [V] (any device/dtype) -> (token id, logprob record if asked)."""
    logits = logits.detach().float().cpu()
    raw = logits
    if constraint is not None:
        mask = constraint.allowed(logits.shape[-1])
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
    if params.greedy:
        token = int(torch.argmax(logits).item())
    else:
        probs = torch.softmax(filter_logits(logits / params.temperature, params.top_k, params.top_p), dim=-1)
        token = int(torch.multinomial(probs, 1, generator=generator).item())
    record = None
    if params.logprobs is not None:
        logp = torch.log_softmax(raw, dim=-1)
        top = []
        if params.logprobs > 0:
            vals, ids = torch.topk(logp, params.logprobs)
            top = [(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
        record = TokenLogprob(token, float(logp[token]), top)
    return token, record
