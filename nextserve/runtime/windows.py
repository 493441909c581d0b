"""The host side of a step's rows as windows (runtime/runner.py, runtime/pipeline.py): their inputs, and
which rows of verify windows are accepted (engine/speculative.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..cache.decode_rows import WINDOW_FIELDS
from ..cache.states import StateSlots
from ..step_plan import Chunk, TokenLogprob


def window_inputs(chunks: list[Chunk], W: int, states: StateSlots) -> tuple[np.ndarray, list[list[int]]]:
    """Host inputs [5, W, B] (see cache.decode_rows.fill_window) and block tables of one step of
    `chunks`, distinct sequences: a decode step (W = 1) or verify windows, chunk b's row j being its
    last token (j = 0) or draft j at position start + j. A window of fewer rows pads the rest; its
    rows but the last keep their state in the slot's keep slots."""
    B, scratch = len(chunks), states.scratch_slot
    if W == 1:  # a decode step: one row each, whole fields at once (the hot path)
        for ch in chunks:
            ch.seq.cache.own_page_at(ch.start)
        ids = [ch.seq.token_at(ch.start) for ch in chunks]
        slots = [ch.seq.cache.slot for ch in chunks]
        rows = [ids, [ch.start for ch in chunks], slots, [scratch] * B, range(B)]
        return np.array(rows, dtype=np.int64)[:, None], [ch.seq.cache.block_table for ch in chunks]
    inputs = np.zeros((WINDOW_FIELDS, W, B), dtype=np.int64)
    inputs[2:4], inputs[4] = scratch, -1  # padding rows: the scratch slot and table row
    ids, pos, slots, keep, bs, js = [], [], [], [], [], []  # one entry per real row, then one assignment
    for b, ch in enumerate(chunks):
        n, cache = 1 + len(ch.drafts), ch.seq.cache
        for p in range(ch.start, ch.start + n):
            cache.own_page_at(p)
        first = states.keep_slot(cache.slot, n - 2) - (n - 2) if n > 1 else scratch  # keep_slot(slot, 0)
        ids += [ch.seq.token_at(ch.start), *ch.drafts]
        pos += range(ch.start, ch.start + n)
        slots += [cache.slot] * n
        keep += [*range(first, first + n - 1), scratch]  # keep_slot(slot, j) for j < n - 1
        bs += [b] * n
        js += range(n)
    inputs[:, js, bs] = [ids, pos, slots, keep, bs]
    return inputs, [ch.seq.cache.block_table for ch in chunks]


def accept_windows(
    chunks: list[Chunk], logits: torch.Tensor, top: torch.Tensor | None
) -> list[list[tuple[int, TokenLogprob | None]] | Exception]:
    """Each window's sampled rows (sample_window), or the exception that ends its request. Plain greedy
    windows read the argmax of their rows, the others move their rows to the CPU sampler."""
    plain = [b for b, ch in enumerate(chunks) if plain_greedy(ch)]
    rest = [b for b, ch in enumerate(chunks) if not plain_greedy(ch)]
    tops = (top if top is not None else logits.argmax(dim=-1)).tolist() if plain else None  # [W][B]
    rows = logits[:, rest].float().cpu() if rest else None  # [W, R, V]
    out: list = [None] * len(chunks)
    for b in plain:
        out[b] = sample_window(chunks[b], lambda j, b=b: (tops[j][b], None))
    for i, b in enumerate(rest):
        ch = chunks[b]
        try:
            out[b] = sample_window(ch, lambda j, i=i, ch=ch: ch.seq.sample(rows[j, i], ch.drafts[:j]))
        except Exception as exc:  # noqa: BLE001 - that request only
            out[b] = exc
    return out


def sample_window(
    ch: Chunk, sample: Callable[[int], tuple[int, TokenLogprob | None]]
) -> list[tuple[int, TokenLogprob | None]]:
    """A verify window's rows sampled in order (`sample(j)`: row j's token as the request's own sampler
    picks it), up to the first sampled token that differs from its draft (kept too: it is the next
    token), or all 1 + k of them."""
    sampled = []
    for j in range(len(ch.drafts) + 1):
        sampled.append(sample(j))
        if j == len(ch.drafts) or sampled[-1][0] != ch.drafts[j]:
            break
    return sampled


def plain_greedy(ch: Chunk) -> bool:
    """Greedy with no logprobs, no grammar, no penalties or logit_bias: its token is the argmax of the
    model's logits, taken on the device."""
    p = ch.seq.params
    return p.greedy and p.logprobs is None and ch.seq.constraint is None and not p.adjusts_logits
