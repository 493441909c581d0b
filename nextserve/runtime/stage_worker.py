"""What every pipeline stage runs each step (runtime/pipeline.py): the step message the driver sends,
and a stage's share of it, its layers over the step's batches on its own planes and device, each item's
streams passed on to the next stage (the last stage's logits to stage 0)."""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from ..cache.host_store import HostImage, into_pool, to_host
from ..cache.kv_pool import KVPool
from ..cache.sequence import SequenceCache
from ..cache.states import StateSlots
from ..model.batch import ForwardBatch, SeqChunk
from ..model.flash_next import FlashNext
from ..model.mtp import MTP
from ..ops.pdl import pdl_mode
from ..ops.pinned import upload
from .graph_runner import GraphRunner
from .pipeline_windows import GuessWork
from .runner import ModelRunner
from .stage_channel import StageChannel
from .stage_codec import wire_type
from .stage_mtp import KeptStreams, MtpWork, draft_on_last_stage
from .stage_transport import HostTransport, NcclTransport

log = logging.getLogger("nextserve.pipeline")
TRACE_ENV = "NEXTSERVE_STAGE_TRACE"  # a directory: each stage appends its items' times (stage-R.jsonl)


@wire_type
@dataclass(frozen=True)
class PrefillWork:
    slot: int
    table: list[int]
    start: int
    ids: list[int]
    sample: bool


@wire_type
@dataclass(frozen=True)
class DecodeWork:
    ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]


@wire_type
@dataclass(frozen=True)
class WindowsWork:
    """A step's verify windows (engine/speculative.py) as one window of W steps (ModelRunner.window_inputs:
    inputs [5, W, B], the B block tables), every row's logits to stage 0. A window with a rejected draft
    is rewound by a `rewind` op of the next step (StageMirror), from the keep slots its steps wrote."""

    inputs: np.ndarray
    tables: list[list[int]]


@wire_type
@dataclass(frozen=True)
class StageStep:
    ops: list[tuple]  # the driver's cache operations since the last step (StageMirror), in order
    prefills: list[PrefillWork]
    decodes: tuple[DecodeWork, ...] = ()  # decode groups (one, without --decode-groups), each an item
    windows: WindowsWork | None = None
    mtp: MtpWork | None = None  # the last step's MTP rows, for the last stage (stage_mtp.py)
    guess: GuessWork | None = None  # the guessed window after `windows` (pipeline_windows.py)


class StageWorker(ModelRunner):
    """A stage's share of each step: its layers over the step's batches, on its own planes and device."""

    def __init__(
        self, model: FlashNext, pool: KVPool, slots: StateSlots, channel: StageChannel,
        transport: HostTransport | NcclTransport, device: torch.device, pdl: bool = False,
        mtp: MTP | None = None, draft_tokens: int = 0, embed: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """`mtp`: the last stage's MTP block, drafting up to `draft_tokens` from `embed` (stage_mtp.py)."""
        super().__init__(model, device, pool, slots, pdl=pdl, mtp=mtp, draft_tokens=draft_tokens, embed=embed)
        self.channel, self.transport = channel, transport
        self.kept = KeptStreams() if self.drafter is not None else None
        self.nH = model.cfg.hc_hidden
        self.saved: dict[int, dict[str, torch.Tensor]] = {}  # this stage's prefix-image slot states
        self.host_saved: dict[int, HostImage] = {}  # its share of the images in the driver's host store
        trace_dir = os.environ.get(TRACE_ENV)
        self.trace = None if not trace_dir else os.path.join(trace_dir, f"stage-{channel.rank}.jsonl")

    def _apply(self, ops: list[tuple]) -> None:
        """Repeat the driver's cache operations on this stage's planes (stage 0 did them itself)."""
        for op, *args in ops:
            if op == "copy_page":
                self.pool.copy_page(*args)
            elif op == "save":
                key, slot = args
                self.saved[key] = self.states.copy_out(slot)
            elif op == "load":
                key, slot = args
                self.states.copy_in(slot, self.saved[key])
            elif op == "drop":
                self.saved.pop(args[0], None)
            elif op == "spill":  # the image's pages are free after this: copy them out first
                key, host_id, pages = args
                self.host_saved[host_id] = to_host(self.pool, 0, self.saved[key], pages)
            elif op == "unspill":
                host_id, pages, key = args
                self.saved[key] = into_pool(self.pool, pages, self.host_saved[host_id])
            elif op == "rewind":
                self.states.rewind(*args)
            else:  # host_drop
                self.host_saved.pop(args[0], None)

    # NOTE: every stage sends every item (a prefill chunk, the decode batch) on, a status first, so the
    # stages stay in step when one fails (C2): a stage whose forward raised, or whose input came marked
    # failed, sends "failed" and zeros. The last stage sends each item's status to stage 0, then the
    # logits of its sampling rows (zeros when failed); stage 0 fails that item's requests only. Statuses
    # go over Gloo (host), the tensors by the transport, each in item order.
    def _stream_in(self, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor | None, bool]:
        r = self.channel.rank
        if r == 0:
            return None, True
        ok = bool(self.channel.recv((1,), torch.int8, r - 1)[0])
        return self.transport.recv((rows, self.nH), dtype, r - 1), ok

    def _item(
        self, kind: str, forward, rows: int, sample_rows: torch.Tensor | None, dtype: torch.dtype,
        sequences: int = 1, ask: bool = False,
    ) -> None:  # fmt: skip
        """Run one item (of `sequences` sequences) through this stage (forward(x_in) -> streams) and send
        it on; the last stage keeps its streams when it drafts. `ask`: the last stage runs it only when
        stage 0 then says so (a guessed window), else drops its input and sends nothing back."""
        r, last = self.channel.rank, self.channel.world - 1
        waited = time.time()
        x_in, ok = self._stream_in(rows, dtype)
        if ask and r == last and not self.channel.recv((1,), torch.int8, 0)[0]:
            return
        x = logits = None
        t0 = time.time()
        if ok:
            try:
                x = forward(x_in)
                if r == last and sample_rows is not None:
                    logits = self.model.logits(x[sample_rows], row_invariant=True)
            except Exception:  # noqa: BLE001 - that item's requests only (C2)
                log.exception("pipeline stage %d: forward failed", r)
                ok = False
        stamps = None
        if self.trace is not None:
            if x is not None and x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            stamps = {"kind": kind, "rows": rows, "waited": waited, "start": t0, "end": time.time()}
        if self.kept is not None:
            self.kept.add(kind, x if ok else None, rows, sequences)
        self._send_on(ok, x, logits, rows, sample_rows, dtype)
        if stamps is not None:
            self._trace(stamps)

    def _send_on(self, ok: bool, x, logits, rows: int, sample_rows, dtype: torch.dtype) -> None:
        """An item's status and streams to the next stage; the last stage's to stage 0, with the logits of its
        sampling rows (zeros for a failed item)."""
        r, last = self.channel.rank, self.channel.world - 1
        status = torch.tensor([int(ok)], dtype=torch.int8)
        if r < last:
            self.channel.send(status, r + 1)
            self.transport.send(x if ok else self._zeros(rows, self.nH, dtype), r + 1)
            return
        self.channel.send(status, 0)
        if sample_rows is not None:
            V = self.model.cfg.vocab_size
            self.transport.send(logits if ok else self._zeros(len(sample_rows), V, dtype), 0)

    def _trace(self, stamps: dict) -> None:
        """Append when this stage began waiting for an item's input (`waited`), computed it (`start` to `end`)
        and had sent it on (`sent`): wall clock, comparable across the stages of one machine; a GPU stage
        waits for its work before `end`, so only set TRACE_ENV to look."""
        with open(self.trace, "a") as f:
            f.write(json.dumps(stamps | {"sent": time.time()}) + "\n")

    def _zeros(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(rows, cols, dtype=dtype, device=self.device)

    def run(self, step: StageStep, dtype: torch.dtype) -> None:
        with pdl_mode(self.pdl), torch.inference_mode():
            self._run(step, dtype)
        if self.channel.rank:
            # NOTE: not waited for: a send completes when its receiver takes it, and stage 0 may take an
            # item's logits only after sending this stage more work (decode groups)
            self.channel.reap()
            self.transport.flush()

    def flush(self) -> None:
        """Wait for this step's sends (Gloo's on the host; NCCL's: the current stream waits for them)."""
        self.channel.flush()
        self.transport.flush()

    def _chunk(self, slot: int, table: list[int], start: int, ids: list[int]) -> ForwardBatch:
        cache = SequenceCache(self.pool, self.states, slot=slot, block_table=table)
        ids_t = upload(ids, torch.long, self.device)
        pos = torch.arange(start, start + len(ids), device=self.device)
        return ForwardBatch(ids_t, pos, [SeqChunk(cache, start, len(ids))], row_invariant=False)

    def _run(self, step: StageStep, dtype: torch.dtype) -> None:
        dev = self.device
        if self.channel.rank:
            self._apply(step.ops)
        if step.windows is not None:
            _, W, B = step.windows.inputs.shape
            rows = torch.arange(W * B, device=dev)
            self._item("windows", lambda x, w=step.windows: self._windows(w, x), W * B, rows, dtype, B)
        if step.guess is not None:
            g, n = step.guess, step.guess.inputs.shape[1]
            rows = torch.arange(n, device=dev)
            self._item("guess", lambda x: self._guess(g, x), n, rows, dtype, ask=True)
        for w in step.prefills:
            if w.start == 0:
                self.states.reset(w.slot)  # a new sequence (stage 0 resets at allocation)
            n = len(w.ids)
            batch = self._chunk(w.slot, w.table, w.start, w.ids)
            sample_rows = torch.tensor([n - 1], device=dev) if w.sample else None
            self._item("prefill", lambda x, b=batch: self.model(b, x), n, sample_rows, dtype)
        for d in step.decodes:
            rows = torch.arange(len(d.ids), device=dev)
            self._item("decode", lambda x, d=d: self._decode(d, x), len(d.ids), rows, dtype)
        if step.mtp is not None and self.kept is not None:
            kept = self.kept.take()
            draft_on_last_stage(self.drafter, self.pool, self.states, self.channel, step.mtp, kept)

    def capture_graphs(self, max_pages: int, max_rows: int, max_drafts: int = 0) -> None:
        """This stage's decode steps and verify windows (up to max_drafts drafts) as CUDA graphs per
        batch-size bucket, streams out (the last stage's logits, of the rows that sample, are computed
        after the replay as for an eager step)."""
        self.graphs = GraphRunner(
            self.model, self.pool, self.states, max_pages, max_rows, max_drafts, self.drafter, logits=False
        )
        with pdl_mode(self.pdl):  # the graphs hold the launches as captured
            self.graphs.capture()
        if self.drafter is not None:
            self.drafter.graphs = self.graphs

    def _decode(self, d: DecodeWork, x: torch.Tensor | None) -> torch.Tensor:
        """A decode item's streams after this stage's layers [n, nH] (x: the previous stage's): a window
        of one row each."""
        n = len(d.ids)
        rows = [d.ids, d.positions, d.slots, [self.states.scratch_slot] * n, range(n)]
        return self._windows(WindowsWork(np.array(rows, dtype=np.int64)[:, None], d.tables), x)

    def _guess(self, g: GuessWork, x: torch.Tensor | None) -> torch.Tensor:
        """A guessed window's streams after this stage's layers [W2, nH], on the shadow slot forked from
        the window's slot as this stage left it (pipeline_windows.py)."""
        self.states.fork(g.slot, g.shadow)
        return self._windows(WindowsWork(g.inputs, g.tables), x)

    def _windows(self, w: WindowsWork, x: torch.Tensor | None) -> torch.Tensor:
        """Streams after this stage's layers [W*B, nH] of W steps of B rows (verify windows, or a decode
        item as W = 1; x: the previous stage's)."""
        _, W, B = w.inputs.shape
        if self.graphs is None or not self.graphs.fits(B, W):
            return self.window_streams(w.inputs, w.tables, x)
        return self._replay(w.inputs, w.tables, x)

    def _replay(self, inputs: np.ndarray, tables: list[list[int]], x: torch.Tensor | None) -> torch.Tensor:
        streams, _, _ = self.graphs.replay(inputs, tables, x)
        # NOTE: a copy: the next replay (the next decode group, the next step) rewrites the graph's output
        # while an NCCL send of it may still be queued (GraphRunner also waits for its last upload before
        # refilling its pinned inputs: a stage's host does not wait for its GPU).
        return streams.flatten(0, 1).clone()


def on_device(device: torch.device):
    """Make `device` the current CUDA device (Triton launches and NCCL streams follow it)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()
