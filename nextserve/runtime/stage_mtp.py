"""MTP speculation through pipeline stages (runtime/pipeline.py): the MTP block on the last stage, which
holds the target's last layers and lm_head, drafting from the streams it computed in the step.

# NOTE: the drafts of a step need its sampled tokens, which stage 0 samples from the last stage's logits.
# So after a step the driver sends one more message (a StageStep whose `mtp` is set) to every stage: its
# cache operations since the step (page copies for the chain's positions), which every stage repeats,
# and for the last stage each committed chunk's rows (positions, the committed tokens, the token sampled
# after them, the chain to draft) naming the streams the last stage kept of that chunk in the step. The
# last stage runs exactly the one-process drafter (MtpDrafter.run) on them and sends back a status and
# the drafts. The streams, tokens and order of the MTP rows are the single process's, so are the drafts,
# bit for bit (tests/runtime/test_pipeline_mtp.py); drafts never change an output (C1), so an MTP
# failure there only loses them, as in one process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..cache.kv_pool import KVPool
from ..cache.sequence import SequenceCache
from ..cache.states import StateSlots
from ..step_plan import StepPlan
from .mtp_runner import MtpDrafter, MtpRows
from .runner import ChunkResult, committed_rows
from .stage_channel import StageChannel
from .stage_codec import wire_type

log = logging.getLogger("nextserve.pipeline")
LOST = "MTP drafting failed"  # the log line of lost drafts, in either process


@wire_type
@dataclass(frozen=True)
class MtpWork:
    """The committed rows of a step's chunks, one entry per chunk: which of the last stage's kept streams
    (`KeptStreams`: the verify windows' sequences, then the prefill chunks, in launch order) and the
    MtpRows fields but the streams (sampled -1: none)."""

    kept: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    ids: list[list[int]] = field(default_factory=list)
    row_invariant: list[bool] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    chains: list[int] = field(default_factory=list)


class KeptStreams:
    """The last stage's streams of a step's items, for the MTP message that follows the step: per verify
    window sequence its rows [W, nH] (and a held guessed window's after them), per prefill chunk its rows
    [n, nH], None where the item failed."""

    def __init__(self) -> None:
        self.streams: list[torch.Tensor | None] = []

    def add(self, kind: str, x: torch.Tensor | None, rows: int, sequences: int) -> None:
        if kind == "prefill":
            self.streams.append(x)
        elif kind == "windows":
            per = None if x is None else x.view(rows // sequences, sequences, -1)
            self.streams += [None if per is None else per[:, b] for b in range(sequences)]
        elif kind == "guess":  # the step's one verify window's sequence (pipeline_windows.py)
            window = self.streams[-1]
            self.streams[-1] = None if x is None or window is None else torch.cat([window, x])

    def take(self) -> list[torch.Tensor | None]:
        streams, self.streams = self.streams, []
        return streams


def mtp_work(plan: StepPlan, results: list[ChunkResult], k: int) -> tuple[MtpWork, list[ChunkResult]]:
    """The driver's MTP message of a step and the results it drafts for (its committed chunks, in
    order). The pages of each chain's positions are owned first (copy-on-write), as MtpDrafter does:
    the copies go to every stage with the message."""
    # NOTE: by sequence and start, not by chunk: a held guessed window's result names its pair's chunk
    # (pipeline_windows.pair_chunk), whose kept streams are the window's and the guess's together
    index = {(id(ch.seq), ch.start): b for b, ch in enumerate(plan.verifies)}
    index |= {(id(ch.seq), ch.start): len(plan.verifies) + i for i, ch in enumerate(plan.prefills)}
    work, owners = MtpWork(), []
    for r in results:
        i = index.get((id(r.chunk.seq), r.chunk.start))
        if i is None or r.error is not None:
            continue
        c, cache = committed_rows(r, k), r.chunk.seq.cache
        end = c.start + len(c.ids)
        if c.sampled is not None:
            for p in range(end - 1, end - 1 + c.chain):
                cache.own_page_at(p)
        work.kept.append(i)
        work.slots.append(cache.slot)
        work.tables.append(list(cache.block_table))
        work.starts.append(c.start)
        work.ids.append(c.ids)
        work.row_invariant.append(c.row_invariant)
        work.sampled.append(-1 if c.sampled is None else c.sampled)
        work.chains.append(c.chain)
        owners.append(r)
    return work, owners


def draft_on_last_stage(
    drafter: MtpDrafter, pool: KVPool, states: StateSlots, channel: StageChannel, work: MtpWork,
    kept: list[torch.Tensor | None],
) -> None:  # fmt: skip
    """Run the message's MTP rows and chains (MtpDrafter.run), then send stage 0 a status and the
    drafts [items, k] int64 (each item's first `chain` entries are its drafts)."""
    out = torch.zeros(len(work.kept), drafter.k, dtype=torch.long)
    ok = True
    try:
        items = [
            MtpRows(SequenceCache(pool, states, slot=slot, block_table=table), start, kept[i][: len(ids)],
                    ids, ri, None if s < 0 else s, chain)
            for i, slot, table, start, ids, ri, s, chain in zip(
                work.kept, work.slots, work.tables, work.starts, work.ids, work.row_invariant, work.sampled,
                work.chains, strict=True,
            )
        ]  # fmt: skip
        if items:
            for j, drafts in enumerate(drafter.run(items)):
                out[j, : len(drafts)] = torch.tensor(drafts, dtype=torch.long)
    except Exception:  # noqa: BLE001 - drafts are a speed-up: their loss changes no output (C1)
        log.exception(LOST)
        ok = False
    channel.send(torch.tensor([int(ok)], dtype=torch.int8), 0)
    channel.send(out, 0)


def receive_drafts(channel: StageChannel, owners: list[ChunkResult], work: MtpWork, k: int) -> None:
    """The last stage's answer to an MTP message: each owner's drafts (none when the stage failed)."""
    last = channel.world - 1
    ok = bool(channel.recv((1,), torch.int8, last)[0])
    drafts = channel.recv((len(owners), k), torch.long, last)
    if not ok:
        log.error("%s on the last pipeline stage (its log has the traceback)", LOST)
        return
    for j, (r, chain) in enumerate(zip(owners, work.chains, strict=True)):
        r.drafts = tuple(drafts[j, :chain].tolist())
