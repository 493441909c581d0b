"""Pipeline windows (--pipeline-windows): while the last stage verifies a sequence's window n, the front
stages run the MTP-guessed window n + 1 on a shadow copy of their state (DESIGN.md "Pipeline").

The guess: with windows on, the last stage's MTP block chains 2k + 1 drafts, not k (`mtp_tokens`); the
first k are window n's drafts, the rest the guessed window n + 1: the token guessed to follow window n's
last draft, then k drafts after it (Chunk.guess, the scheduler's for a sequence decoding alone).

# NOTE: why the outputs do not change (C1). The pair is one verify window of ch.drafts + ch.guess whose
# rows are computed in two parts: window n on the sequence's slot, then the guessed rows on the shadow
# slot, whose state each stage forks from the slot just after window n (StateSlots.fork) and which keeps
# the guessed rows' states in its own keep slots. A row's logits are those of the serial decode step at its
# position whichever slot it runs on (its state is the one serial decode has there, when every row before
# it holds), and the rows are sampled in order with the request's sampler, each accepted only when it
# equals the draft (`sample_pair`): exactly a verify window's rule (engine/speculative.py). The last
# stage runs the guessed rows only after stage 0 found every row of window n accepted and its last sampled
# token equal to the guess's first (held); otherwise it drops their streams, and the front stages' shadow
# work is forgotten. Committing copies the state after the last committed row into the sequence's slot
# (`commit_location`, a rewind mirrored to every stage). KV and indexer block keys written at guessed
# positions are position-addressed: a dropped guess's are rewritten by the real tokens there before any
# row reads them, as a rejected draft's are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..cache.decode_rows import WINDOW_FIELDS
from ..cache.states import StateSlots
from ..engine_config import EngineConfig
from ..step_plan import Chunk, TokenLogprob
from .stage_codec import wire_type
from .windows import plain_greedy, sample_window


def mtp_tokens(config: EngineConfig) -> int:
    """Drafts the MTP block on the last stage chains per window (0: no MTP speculation): k, or with
    pipeline windows 2k + 1 (the window's k drafts, then the guessed window's k + 1 tokens)."""
    if config.speculative_method != "mtp":
        return 0
    k = config.speculative_tokens
    return 2 * k + 1 if config.pipeline_windows else k


@wire_type
@dataclass(frozen=True)
class GuessWork:
    """A step's guessed window (inputs [5, W2, 1] on the shadow slot, its block table): every stage forks
    `slot`'s state into `shadow` first; the front stages run it at once, the last stage only when stage 0
    says the guess held."""

    slot: int
    shadow: int
    inputs: np.ndarray
    tables: list[list[int]]


def guess_work(ch: Chunk, shadow: int, states: StateSlots) -> GuessWork:
    """The guessed window after `ch`: row j is guess token j at position ch.end + j on the shadow slot,
    keeping its state in the shadow's keep slot j (the last row's is the shadow slot's own). Its pages are
    owned first (copy-on-write), as a window's are."""
    n, cache = len(ch.guess), ch.seq.cache
    for p in range(ch.end, ch.end + n):
        cache.own_page_at(p)
    inputs = np.zeros((WINDOW_FIELDS, n, 1), dtype=np.int64)
    keep = [states.keep_slot(shadow, j) for j in range(n - 1)] + [states.scratch_slot]
    inputs[:, :, 0] = [list(ch.guess), list(range(ch.end, ch.end + n)), [shadow] * n, keep, [0] * n]
    return GuessWork(cache.slot, shadow, inputs, [list(cache.block_table)])


def pair_chunk(ch: Chunk) -> Chunk:
    """`ch` and its guessed window as one verify window (what a held pair commits)."""
    drafts = ch.drafts + ch.guess
    return replace(ch, end=ch.start + 1 + len(drafts), drafts=drafts, guess=())


def sample_pair(
    ch: Chunk, first: torch.Tensor, second: Callable[[], torch.Tensor], eos: int | None
) -> tuple[list[tuple[int, TokenLogprob | None]], bool]:
    """The rows of `ch`'s window (logits first [W, V]) sampled in order (windows.sample_window), then, if
    all held, its last sampled token is the guess's first and none of them ends the request, the rows of
    the guessed window (second() [W2, V]: asked for only then) as the rows after them in one window of
    ch.drafts + ch.guess. Returns the sampled rows and whether the guessed window was used (held)."""
    drafts, W, p = ch.drafts + ch.guess, first.shape[0], ch.seq.params
    halves, tops = [first], []
    greedy = plain_greedy(ch)

    def row(j: int) -> tuple[int, TokenLogprob | None]:
        """Row j of the pair as the request's sampler picks it (after the pair's tokens before it)."""
        half, i = divmod(j, W)
        if greedy:
            if len(tops) <= half:
                tops.append(halves[half].argmax(dim=-1).tolist())
            return tops[half][i], None
        return ch.seq.sample(halves[half][i].float().cpu(), drafts[:j])

    sampled = sample_window(ch, row)
    ends = any(t in p.stop_token_ids or (t == eos and not p.ignore_eos) for t, _ in sampled)
    if len(sampled) < W or sampled[-1][0] != ch.guess[0] or ends:  # (an end: the guess would be cut off)
        return sampled, False
    halves.append(second())
    return sampled + sample_window(replace(ch, drafts=ch.guess[1:]), lambda j: row(W + j)), True


def commit_location(states: StateSlots, slot: int, shadow: int, W: int, W2: int, n_kept: int) -> int:
    """Where the state after the n_kept-th row of a window of W rows on `slot` and its guessed window of W2
    rows on `shadow` is: a keep slot of either, or either slot itself (the last row of its part)."""
    i = n_kept - 1
    if i < W:
        return slot if i == W - 1 else states.keep_slot(slot, i)
    return shadow if i - W == W2 - 1 else states.keep_slot(shadow, i - W)
