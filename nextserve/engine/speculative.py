"""Speculative decoding: draft tokens proposed from the sequence itself (n-gram prompt lookup) or by the
model's MTP block (runtime/mtp_runner.py), checked by one verify window of the target model, committed up
to the first token the target would not have chosen.

# NOTE: why speculation never changes an output (C1):
# - a verify window is one row-invariant forward of [last token, d_1 .. d_k] at consecutive positions:
#   row j gets the logits a serial decode step at that position gets (tests/engine/test_speculative.py
#   checks them bit for bit against serial decode);
# - its rows are sampled in order with the request's own sampler and generator, exactly as serial
#   decode samples them, and a draft is accepted only when it *equals* the sampled token (no rejection
#   sampling, whose accepted tokens follow the right distribution but not the serial reference's
#   draws). The first sampled token that differs from its draft is committed too and ends the window,
#   so the generator advances once per committed token, as in serial decode;
# - state past the last committed position is undone: the state slot is copied before the window and,
#   when a draft was rejected, copied back and the committed prefix of the window run again. KV, block
#   keys and compressed rows written at rejected positions are position-addressed and never read
#   before the real token at that position rewrites them.
# Nothing here depends on where the drafts come from: garbage drafts cost speed, never an output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..config import ConfigError

if TYPE_CHECKING:
    from .sequence import Sequence


class Proposer(Protocol):
    def drafts(self, seq: Sequence, limit: int) -> list[int]:
        """Up to `limit` draft tokens to follow seq's tokens (its next verify window's)."""
        ...


def _check_k(k: object) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        raise ConfigError(f"speculative_tokens must be a positive integer, got {k!r}")


@dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the sequence's
    last n tokens, trying n = max_n down to min_n (the longest match wins)."""

    k: int  # draft tokens per window at most
    max_n: int = 3
    min_n: int = 2

    def __post_init__(self) -> None:
        _check_k(self.k)
        if not 1 <= self.min_n <= self.max_n:
            raise ConfigError(f"n-gram sizes need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")

    def drafts(self, seq: Sequence, limit: int) -> list[int]:
        return self.propose(seq.all_ids, limit)

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) draft tokens to follow `tokens` (none when no n-gram recurs)."""
        k = min(self.k, limit)
        if k <= 0:
            return []
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            key = tokens[L - n :]
            for i in range(L - n - 1, -1, -1):  # the most recent earlier occurrence first
                if tokens[i : i + n] == key:
                    return tokens[i + n : i + n + k]
        return []


@dataclass(frozen=True)
class MtpProposer:
    """The MTP block's greedy chain after the sequence's last committed token: computed at the end of
    the step that committed it (runtime/mtp_runner.py) and kept on the sequence until this schedule."""

    k: int  # draft tokens per window at most

    def __post_init__(self) -> None:
        _check_k(self.k)

    def drafts(self, seq: Sequence, limit: int) -> list[int]:
        # NOTE: Sequence.drafts is replaced by every step that computes seq, so it always belongs to
        # seq's current last token (an empty chain after an MTP failure: a plain decode step then).
        return list(seq.drafts[: min(self.k, limit)])

    def guess(self, seq: Sequence, limit: int) -> list[int]:
        """The chain's tokens after the next window's k drafts, up to the (k + 1)-row window that follows
        it, with the drafts at most `limit` tokens in all (--pipeline-windows: the chain is then 2k + 1
        long, runtime/pipeline.py)."""
        return list(seq.drafts[self.k : min(2 * self.k + 1, limit)])
