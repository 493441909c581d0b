"""Pipeline stages: the model's layers split into contiguous ranges, one process per stage, activations
passed stage to stage (DESIGN.md "Pipeline"). This first runtime runs on CPUs over Gloo, one microbatch
in flight: every stage runs each step's prefill chunk and decode batch in turn.

# NOTE: the engine process is stage 0 and the driver: its scheduler allocates state slots and KV pages
# for every stage, since each stage holds its own layers' planes of the same sizes, indexed alike. A
# step is broadcast as a `StageStep` (each chunk's slot, block table, positions and token ids); every
# stage rebuilds the same batches on its own planes. Activations cross stages as raw bytes, so they
# arrive bit for bit (C1): a split model gives the whole model's logits exactly
# (tests/model/test_stages.py, tests/runtime/test_pipeline.py). The last stage sends the logits of the
# rows that choose a token to stage 0, which samples them as a single device does.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache.kv_pool import KVPool
from ..cache.sequence import SequenceCache
from ..cache.states import KindRange, StateSlots
from ..config import ModelConfig
from ..engine.scheduler import StepPlan
from ..model.batch import ForwardBatch, SeqChunk
from ..model.flash_next import FlashNext
from ..model.loader import load_weights
from .runner import ChunkResult, ModelRunner, _describe
from .stage_channel import StageChannel, free_port
from .stage_mirror import StageMirror

log = logging.getLogger("nextserve.pipeline")


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """Contiguous layer ranges, as even as can be (the first stages take one more)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{stages} stages for {num_layers} layers")
    size, extra = divmod(num_layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + size + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


@dataclass(frozen=True)
class StageSetup:
    """What a stage process needs to build itself (picklable)."""

    model_dir: str
    cfg: ModelConfig
    layers: range
    dtype: torch.dtype
    num_slots: int
    num_pages: int
    page_size: int
    rank: int
    world: int
    port: int
    threads: int  # the driver's torch threads: a CPU GEMM's reduction order may follow the thread count


@dataclass(frozen=True)
class PrefillWork:
    slot: int
    table: list[int]
    start: int
    ids: list[int]
    sample: bool


@dataclass(frozen=True)
class DecodeWork:
    ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]


@dataclass(frozen=True)
class StageStep:
    ops: list[tuple]  # the driver's cache operations since the last step (StageMirror), in order
    prefills: list[PrefillWork]
    decode: DecodeWork | None


def build_stage(
    model_dir: str, cfg: ModelConfig, layers: range, dtype: torch.dtype, num_slots: int, num_pages: int,
    page_size: int, device: torch.device | str = "cpu",
) -> tuple[FlashNext, KVPool, StateSlots]:  # fmt: skip
    """One stage's layers (with their weights only), state slots and KV pool."""
    last = layers.stop == cfg.num_hidden_layers
    weights = load_weights(
        Path(model_dir), cfg, layers, with_embed=layers.start == 0, with_head=last, dtype=dtype, device=device
    )
    with torch.device(device):
        model = FlashNext(cfg, layers).to(dtype)
    model.load_state_dict(weights, strict=True)
    model.eval().fuse_projections()
    kinds = KindRange.of(cfg, layers)
    slots = StateSlots(cfg, num_slots, len(kinds.attn), dtype, device, kinds=kinds)
    pool = KVPool(cfg, len(kinds.attn), num_pages, page_size, dtype, device, first_attn=kinds.attn.start)
    return model, pool, slots


class StageWorker(ModelRunner):
    """A stage's share of each step: its layers over the step's batches, on its own planes."""

    def __init__(self, model: FlashNext, pool: KVPool, slots: StateSlots, channel: StageChannel) -> None:
        super().__init__(model, torch.device("cpu"), pool, slots)
        self.channel = channel
        self.nH = model.cfg.hc_hidden
        self.saved: dict[int, dict[str, torch.Tensor]] = {}  # this stage's prefix-image slot states

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
            else:  # drop
                self.saved.pop(args[0], None)

    # NOTE: every stage sends every item (a prefill chunk, the decode batch) on, a status first, so the
    # stages stay in step when one fails (C2): a stage whose forward raised, or whose input came marked
    # failed, sends "failed" and zeros. The last stage sends each item's status to stage 0, then the
    # logits of its sampling rows (zeros when failed); stage 0 fails that item's requests only.
    def _stream_in(self, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor | None, bool]:
        r = self.channel.rank
        if r == 0:
            return None, True
        ok = bool(self.channel.recv((1,), torch.int8, r - 1)[0])
        return self.channel.recv((rows, self.nH), dtype, r - 1), ok

    def _item(self, forward, rows: int, sample_rows: torch.Tensor | None, dtype: torch.dtype) -> None:
        """Run one item through this stage (forward(x_in) -> streams) and send it on."""
        r, last = self.channel.rank, self.channel.world - 1
        x_in, ok = self._stream_in(rows, dtype)
        x = logits = None
        if ok:
            try:
                x = forward(x_in)
                if r == last and sample_rows is not None:
                    logits = self.model.logits(x[sample_rows], row_invariant=True)
            except Exception:  # noqa: BLE001 - that item's requests only (C2)
                log.exception("pipeline stage %d: forward failed", r)
                ok = False
        status = torch.tensor([int(ok)], dtype=torch.int8)
        if r < last:
            self.channel.send(status, r + 1)
            self.channel.send(x if ok else torch.zeros(rows, self.nH, dtype=dtype), r + 1)
            return
        self.channel.send(status, 0)
        if sample_rows is not None:
            V = self.model.cfg.vocab_size
            self.channel.send(logits if ok else torch.zeros(len(sample_rows), V, dtype=dtype), 0)

    @torch.inference_mode()
    def run(self, step: StageStep, dtype: torch.dtype) -> None:
        if self.channel.rank:
            self._apply(step.ops)
        for w in step.prefills:
            if w.start == 0:
                self.states.reset(w.slot)  # a new sequence (stage 0 resets at allocation)
            cache = SequenceCache(self.pool, self.states, slot=w.slot, block_table=w.table)
            n = len(w.ids)
            ids, pos = torch.tensor(w.ids, dtype=torch.long), torch.arange(w.start, w.start + n)
            batch = ForwardBatch(ids, pos, [SeqChunk(cache, w.start, n)], False)
            self._item(
                lambda x, b=batch: self.model(b, x), n, torch.tensor([n - 1]) if w.sample else None, dtype
            )
        if step.decode is not None:
            d = step.decode
            n = len(d.ids)

            def decode(x: torch.Tensor | None) -> torch.Tensor:
                return self.model.decode(self.decode_batch(d.ids, d.positions, d.slots, d.tables), x)

            self._item(decode, n, torch.arange(n), dtype)
        if self.channel.rank:
            self.channel.flush()


def _exit_with_parent() -> None:
    """End this stage when the driver process ends, however it ends (a watcher thread)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="nextserve-stage-watch").start()


def stage_main(setup: StageSetup) -> None:
    """A stage process (rank >= 1): build, then run the broadcast steps until a None step."""
    torch.set_num_threads(setup.threads)  # the driver's, so its layers compute as in one process (C1)
    _exit_with_parent()
    channel = StageChannel(setup.rank, setup.world, setup.port)
    model, pool, slots = build_stage(
        setup.model_dir, setup.cfg, setup.layers, setup.dtype, setup.num_slots, setup.num_pages,
        setup.page_size,
    )  # fmt: skip
    worker = StageWorker(model, pool, slots, channel)
    channel.broadcast(None)  # ready
    while (step := channel.broadcast(None)) is not None:
        worker.run(step, setup.dtype)


class PipelineRunner(StageWorker):
    """Stage 0 and the driver: broadcasts each step, runs stage 0's share, receives the last stage's
    logits and samples them (the single-device runner's sampling)."""

    def __init__(
        self, model_dir: str, model: FlashNext, pool: KVPool, slots: StateSlots, stages: list[range]
    ):
        port = free_port()
        cfg, dtype = model.cfg, pool.k.dtype
        self.procs: list[subprocess.Popen] = []
        # NOTE: `python -m` children, not multiprocessing's spawn, which would re-run the user's main
        # module in every stage.
        for rank in range(1, len(stages)):
            setup = StageSetup(model_dir, cfg, stages[rank], dtype, slots.num_slots, pool.num_pages,
                               pool.page_size, rank, len(stages), port, torch.get_num_threads())  # fmt: skip
            # NOTE: a session of its own: a terminal's Ctrl-C or a supervisor's signal to the process
            # group reaches the driver only, which then stops the stages in order (`close`).
            proc = subprocess.Popen(
                [sys.executable, "-m", "nextserve.runtime.stage_main"], stdin=subprocess.PIPE,
                start_new_session=True,
            )  # fmt: skip
            proc.stdin.write(pickle.dumps(setup))
            proc.stdin.close()
            self.procs.append(proc)
        super().__init__(model, pool, slots, StageChannel(0, len(stages), port))
        self.mirror = StageMirror(pool, slots)
        self.channel.broadcast(None)  # every stage is built
        self.dtype = dtype

    def execute(self, plan: StepPlan) -> list[ChunkResult]:
        if plan.verifies:
            raise RuntimeError("verify windows are not run by pipeline stages yet")
        prefills = [
            PrefillWork(ch.seq.cache.slot, list(ch.seq.cache.block_table), ch.start,
                        ch.seq.tokens(ch.start, ch.end), ch.sample)
            for ch in plan.prefills
        ]  # fmt: skip
        decode = None
        if plan.decodes:
            ids, positions, slots, tables = self.decode_inputs(plan.decodes)
            decode = DecodeWork(ids, positions, slots, [list(t) for t in tables])
        step = StageStep(self.mirror.take(), prefills, decode)
        self.channel.broadcast(step)
        self.run(step, self.dtype)
        rows, chunks, results = [], [], []
        V, last = self.model.cfg.vocab_size, self.channel.world - 1
        failed = "RuntimeError: the forward failed in a pipeline stage (its log has the traceback)"
        items = [([ch], ch.sample) for ch in plan.prefills] + ([(plan.decodes, True)] if plan.decodes else [])
        with torch.inference_mode():
            for item, sample in items:
                ok = bool(self.channel.recv((1,), torch.int8, last)[0])
                logits = self.channel.recv((len(item), V), self.dtype, last) if sample else None
                if not ok:
                    results += [ChunkResult(ch, error=failed) for ch in item]
                elif sample:
                    rows.append(logits)
                    chunks += item
                else:
                    results += [ChunkResult(ch) for ch in item]
        self.channel.flush()
        if not chunks:
            return results
        try:
            return results + self._sample(chunks, [(torch.cat(rows), None)])
        except Exception as exc:  # noqa: BLE001
            log.exception("sampling failed")
            return results + [ChunkResult(ch, error=_describe(exc)) for ch in chunks]

    def close(self) -> None:
        """Stop the stage processes (idempotent)."""
        if self.procs:
            try:
                self.channel.broadcast(None)
            except RuntimeError as exc:  # a stage already gone: stop the others anyway
                log.warning("pipeline stages did not all take the stop: %s", exc)
            finally:
                for proc in self.procs:
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                self.procs = []
