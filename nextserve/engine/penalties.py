"""What a request's history does to its logits: logit_bias, and the repetition, frequency and presence
penalties (vLLM's and OpenAI's meanings), on the CPU rows the sampler draws from.

A sequence that asks for penalties keeps dense per-token tallies (`TokenTally`), updated as each token is
appended, so a penalty costs O(vocabulary) per sampled row however long the context is. A verify window's
row j also counts the drafts before it (`extra`): with the drafts that were accepted equal to the tokens
sampled, row j sees the history a serial decode would (C1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .sampling import SamplingParams


class TokenTally:
    """Per-token counts of a sequence's output and which tokens its prompt or output holds."""

    def __init__(self, prompt_ids: list[int], vocab_size: int) -> None:
        self.counts = torch.zeros(vocab_size, dtype=torch.int32)  # [V] output tokens
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # [V] prompt or output tokens
        if prompt_ids:
            self.seen[torch.tensor(prompt_ids, dtype=torch.long).clamp_(0, vocab_size - 1)] = True

    def add(self, token: int) -> None:
        if 0 <= token < self.counts.numel():
            self.counts[token] += 1
            self.seen[token] = True

    def with_extra(self, extra: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """counts and seen as if `extra` had been appended too."""
        if not extra:
            return self.counts, self.seen
        ids = torch.tensor(extra, dtype=torch.long).clamp_(0, self.counts.numel() - 1)
        counts = self.counts.index_add(0, ids, torch.ones(len(extra), dtype=torch.int32))
        seen = self.seen.clone()
        seen[ids] = True
        return counts, seen


def adjust_logits(
    logits: torch.Tensor, params: SamplingParams, tally: TokenTally | None, extra: tuple[int, ...] = ()
) -> torch.Tensor:
    """logits [V] float32 with the request's logit_bias and penalties applied (a new tensor when changed)."""
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        keep = ids < logits.numel()
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype)
        logits = logits.index_add(0, ids[keep], bias[keep])
    if tally is None or not params.penalized:
        return logits
    counts, seen = tally.with_extra(extra)
    if params.repetition_penalty != 1.0:
        # HF's and vLLM's rule: a seen token's positive logit is divided by the penalty, a negative one
        # multiplied by it
        p = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
        # NOTE: a penalty near 0 divides past float32's range: +inf would make softmax NaN; held at the
        # largest finite logit instead (the token stays the likeliest, as the penalty means). -inf (masked)
        # logits are left as they are.
        logits = logits.clamp(max=torch.finfo(logits.dtype).max)
    if params.frequency_penalty or params.presence_penalty:
        f = counts.to(logits.dtype)
        logits = (
            logits - params.frequency_penalty * f - params.presence_penalty * (counts > 0).to(logits.dtype)
        )
    return logits
