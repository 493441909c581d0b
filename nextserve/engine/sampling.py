"""SamplingParams and the sampler: temperature, top-k, top-p, min-p, penalties and logit_bias
(engine/penalties.py), per-request seeded generators."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from ..step_plan import TokenLogprob
from .penalties import TokenTally, adjust_logits

# NOTE: a temperature below this samples greedily (vLLM's _SAMPLING_EPS): dividing float32 logits by a
# smaller one overflows to inf, and the distribution is a point mass at the argmax long before.
MIN_TEMPERATURE = 1e-5


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
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest one (0: off)
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output already holds
    frequency_penalty: float = 0.0  # subtracted once per time the output already holds the token
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of tokens seen before
    logit_bias: tuple[tuple[int, float], ...] | dict = ()  # token id -> added to its logit

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
        self._check_adjustments()

    def _check_adjustments(self) -> None:
        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or v > hi or v < lo or (lo_open and v == lo):
                side = "(" if lo_open else "["
                raise ValueError(f"{name} must be in {side}{lo}, {hi}], got {v!r}")

        number("min_p", 0.0, 1.0)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 0.0, 2.0, lo_open=True)
        bias = self.logit_bias
        items = list(bias.items()) if isinstance(bias, dict) else list(bias or ())
        clean = []
        for item in items:
            if not (isinstance(item, tuple | list) and len(item) == 2):
                raise ValueError("logit_bias maps token ids to numbers")
            t, b = item
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
            if not isinstance(b, int | float) or isinstance(b, bool) or not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r}")
            clean.append((t, float(b)))
        object.__setattr__(self, "logit_bias", tuple(sorted(clean)))

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether the output's history changes the logits (a penalty other than its neutral value)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes the model's logits before choosing (penalties, logit_bias)."""
        return self.penalized or bool(self.logit_bias)


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
    tally: TokenTally | None = None,
    extra: tuple[int, ...] = (),
) -> tuple[int, TokenLogprob | None]:
    """One row of logits [V] (any device/dtype) -> (token id, logprob record if asked). `tally`: the
    sequence's TokenTally (penalties), `extra`: tokens after it that it does not count yet (a verify
    window's earlier drafts). Logprobs are of the model's logits, before any adjustment (vLLM's default).

    The order is vLLM's: logit_bias and penalties, the grammar's mask, then greedy argmax, or temperature,
    min-p, top-k and top-p before drawing."""
    logits = logits.detach().float().cpu()
    raw = logits
    if params.adjusts_logits:
        logits = adjust_logits(logits, params, tally, extra)
    if constraint is not None:
        mask = constraint.allowed(logits.shape[-1])
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
    if params.greedy:
        token = int(torch.argmax(logits).item())
    else:
        logits = logits / params.temperature
        if params.min_p > 0.0:
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
        probs = torch.softmax(filter_logits(logits, params.top_k, params.top_p), dim=-1)
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
