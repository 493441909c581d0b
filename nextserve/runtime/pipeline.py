"""Pipeline stages: the model's layers split into contiguous ranges, one process per stage, each on its
own device (the CPU, or a GPU per stage), activations passed stage to stage (DESIGN.md "Pipeline"). One
microbatch in flight: every stage runs each step's prefill chunks and decode batch in turn, decode
eagerly (no CUDA graphs in stages yet).

# NOTE: the engine process is stage 0 and the driver: its scheduler allocates state slots and KV pages
# for every stage, since each stage holds its own layers' planes of the same sizes, indexed alike. A
# step is sent as a `StageStep` (each chunk's slot, block table, positions and token ids); every
# stage rebuilds the same batches on its own planes (stage_worker.py). Activations cross stages as raw
# bytes (over Gloo, through host memory, or GPU to GPU over NCCL: stage_transport.py), so they arrive
# bit for bit (C1): a split model gives the whole model's logits exactly (tests/model/test_stages.py,
# tests/runtime/test_pipeline.py, tests/gpu/test_pipeline_cuda.py). The last stage sends the logits of
# the rows that choose a token to stage 0, which samples them as a single device does. The stage
# processes run stage_main.py.
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..cache.kv_pool import KVPool
from ..cache.states import KindRange, StateSlots
from ..config import EngineConfig, ModelConfig
from ..engine.scheduler import Chunk, StepPlan
from ..model.flash_next import FlashNext
from ..model.loader import load_weights
from .decode_rounds import DecodeRounds, DecodeRow
from .runner import ChunkResult, _describe, sample_window
from .stage_channel import StageChannel, free_port
from .stage_mirror import StageMirror
from .stage_transport import make_transport
from .stage_worker import DecodeWork, PrefillWork, RewindWork, StageStep, StageWorker, WindowWork, on_device

log = logging.getLogger("nextserve.pipeline")
FAILED = "RuntimeError: the forward failed in a pipeline stage (its log has the traceback)"


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
    device: str  # this stage's: "cpu" or "cuda:N"
    transport: str  # "nccl" or "host" (stage_transport.py)
    pdl: bool
    max_context: int  # the engine's: the positions a stage's rotary table covers


def build_stage(
    model_dir: str, cfg: ModelConfig, layers: range, dtype: torch.dtype, num_slots: int, num_pages: int,
    page_size: int, device: torch.device | str = "cpu", max_context: int | None = None,
) -> tuple[FlashNext, KVPool, StateSlots]:  # fmt: skip
    """One stage's layers (with their weights only), state slots and KV pool."""
    last = layers.stop == cfg.num_hidden_layers
    weights = load_weights(
        Path(model_dir), cfg, layers, with_embed=layers.start == 0, with_head=last, dtype=dtype, device=device
    )
    with torch.device(device):
        model = FlashNext(cfg, layers).to(dtype)
    model.load_state_dict(weights, strict=True)
    model.eval().prepare(max_context)
    kinds = KindRange.of(cfg, layers)
    slots = StateSlots(cfg, num_slots, len(kinds.attn), dtype, device, kinds=kinds)
    pool = KVPool(cfg, len(kinds.attn), num_pages, page_size, dtype, device, first_attn=kinds.attn.start)
    return model, pool, slots


class PipelineRunner(StageWorker):
    """Stage 0 and the driver: sends each step to the stages, runs stage 0's share, receives the last stage's
    logits and samples them (the single-device runner's sampling)."""

    def __init__(
        self, config: EngineConfig, model: FlashNext, pool: KVPool, slots: StateSlots, stages: list[range],
        devices: list[torch.device], max_context: int,
    ) -> None:  # fmt: skip
        port = free_port()
        cfg, dtype, kind = model.cfg, pool.k.dtype, config.stage_transport_kind()
        self.procs: list[subprocess.Popen] = []
        # NOTE: `python -m` children, not multiprocessing's spawn, which would re-run the user's main
        # module in every stage.
        for rank in range(1, len(stages)):
            setup = StageSetup(config.model, cfg, stages[rank], dtype, slots.num_slots, pool.num_pages,
                               pool.page_size, rank, len(stages), port, torch.get_num_threads(),
                               str(devices[rank]), kind, config.pdl, max_context)  # fmt: skip
            # NOTE: a session of its own: a terminal's Ctrl-C or a supervisor's signal to the process
            # group reaches the driver only, which then stops the stages in order (`close`).
            proc = subprocess.Popen(
                [sys.executable, "-m", "nextserve.runtime.stage_main"], stdin=subprocess.PIPE,
                start_new_session=True,
            )  # fmt: skip
            proc.stdin.write(pickle.dumps(setup))
            proc.stdin.close()
            self.procs.append(proc)
        try:
            channel = StageChannel(0, len(stages), port)
            with on_device(devices[0]):
                transport = make_transport(kind, channel, devices[0])
        except BaseException:  # no stage is left waiting for a driver that is not coming
            for proc in self.procs:
                proc.kill()
            raise
        super().__init__(model, pool, slots, channel, transport, devices[0], config.pdl)
        self.mirror = StageMirror(pool, slots)
        self.decode_groups = config.decode_groups
        self.kept: list[int] = []  # slots of windows resolved without a rewind, not yet told the stages
        self.channel.broadcast(None)  # every stage is built
        self.dtype = dtype

    def execute(self, plan: StepPlan) -> list[ChunkResult]:
        with on_device(self.device):
            return self._drive(plan)

    def _launch(self, step: StageStep) -> None:
        """Send a step to every stage and run stage 0's share of it (its items then travel on). It carries
        the windows resolved since the last launch that need no rewind (their saved states dropped)."""
        if self.kept:
            step = replace(step, kept=tuple(self.kept))
            self.kept = []
        self.channel.send_step(step)
        self.run(step, self.dtype)

    def _drive(self, plan: StepPlan) -> list[ChunkResult]:
        """Launch the step's items, then take back what the last stage returns, in launch order: verify
        windows (a rejected draft launches a rewind), prefill chunks, and decode groups (each group's
        next round launched as soon as its tokens are sampled)."""
        prefills = [
            PrefillWork(ch.seq.cache.slot, list(ch.seq.cache.block_table), ch.start,
                        ch.seq.tokens(ch.start, ch.end), ch.sample)
            for ch in plan.prefills
        ]  # fmt: skip
        windows = []
        for ch in plan.verifies:
            for p in range(ch.start, ch.end):
                ch.seq.cache.own_page_at(p)  # copy-on-write before the step's ops are taken
            ids = [ch.seq.token_at(ch.start), *ch.drafts]
            windows.append(WindowWork(ch.seq.cache.slot, list(ch.seq.cache.block_table), ch.start, ids))
        rounds = DecodeRounds(plan.decodes, self.decode_groups, self.model.cfg.eos_token_id)
        decodes = [self._decode_work(rows) for rows in rounds.groups]
        self._launch(StageStep(self.mirror.take(), prefills, tuple(decodes), tuple(windows)))
        # NOTE: every stage runs items in launch order and the last stage returns them in that order
        queue = deque(("window", (ch, w), len(w.ids)) for ch, w in zip(plan.verifies, windows, strict=True))
        queue += [("prefill", ch, int(ch.sample)) for ch in plan.prefills]
        queue += [("decode", rows, len(rows)) for rows in rounds.groups]
        results, rows, chunks = [], [], []
        with torch.inference_mode():
            while queue:
                kind, item, n_rows = queue.popleft()
                ok, logits = self._receive(n_rows)
                if kind == "window":
                    ch, w = item
                    result, rewind = self._verify_window(ch, w, logits) if ok else (self._failed(ch), None)
                    if rewind is None:
                        self.kept.append(w.slot)
                        results.append(result)
                    else:
                        self._launch(StageStep(self.mirror.take(), [], (), (), (rewind,)))
                        queue.append(("rewind", result, 0))
                elif kind == "rewind":
                    results.append(item if ok else self._failed(item.chunk))
                elif kind == "prefill":
                    if not ok:
                        results.append(self._failed(item))
                    elif n_rows:
                        rows.append(logits)
                        chunks.append(item)
                    else:
                        results.append(ChunkResult(item))
                elif not ok:
                    rounds.fail(item, FAILED)
                else:
                    rounds.record(item, self._sample([r.chunk for r in item], [(logits, None)]))
                    if active := rounds.active(item):
                        self._launch(StageStep(self.mirror.take(), [], (self._decode_work(active),)))
                        queue.append(("decode", active, len(active)))
        self.flush()
        results += rounds.results()
        if not chunks:
            return results
        try:
            return results + self._sample(chunks, [(torch.cat(rows), None)])
        except Exception as exc:  # noqa: BLE001
            log.exception("sampling failed")
            return results + [ChunkResult(ch, error=_describe(exc)) for ch in chunks]

    def _decode_work(self, rows: list[DecodeRow]) -> DecodeWork:
        """The next round's inputs of decode rows (pages owned first: copy-on-write)."""
        for r in rows:
            r.chunk.seq.cache.own_page_at(r.position)
        caches = [r.chunk.seq.cache for r in rows]
        return DecodeWork([r.token for r in rows], [r.position for r in rows], [c.slot for c in caches],
                          [list(c.block_table) for c in caches])  # fmt: skip

    @staticmethod
    def _failed(ch: Chunk) -> ChunkResult:
        return ChunkResult(ch, error=FAILED)

    def _receive(self, n_rows: int) -> tuple[bool, torch.Tensor | None]:
        """One item's status from the last stage, and its n_rows logits rows (none: n_rows == 0)."""
        last = self.channel.world - 1
        ok = bool(self.channel.recv((1,), torch.int8, last)[0])
        V = self.model.cfg.vocab_size
        return ok, self.transport.recv((n_rows, V), self.dtype, last) if n_rows else None

    def _verify_window(self, ch: Chunk, w: WindowWork, logits: torch.Tensor):
        """(result, rewind or None): the window's rows sampled in order until one differs from its draft
        (ModelRunner._verify's rule); a rejected draft needs every stage rewound (`RewindWork`)."""
        try:
            sampled = sample_window(logits, ch)
        except Exception as exc:  # noqa: BLE001 - that request only (C2)
            log.exception("sampling a verify window failed")
            return ChunkResult(ch, error=_describe(exc)), None
        kept = len(sampled)
        (token, lp), more = sampled[0], sampled[1:]
        result = ChunkResult(ch, token, lp, more=more, computed=ch.start + kept)
        rewind = RewindWork(w.slot, w.table, w.start, w.ids[:kept]) if kept < len(w.ids) else None
        return result, rewind

    def close(self) -> None:
        """Stop the stage processes (idempotent)."""
        if self.procs:
            try:
                self.channel.send_step(None)  # not waited for: a stage already gone never takes it
            except RuntimeError as exc:  # a stage already gone: stop the others anyway
                log.warning("pipeline stages did not all take the stop: %s", exc)
            finally:
                for proc in self.procs:
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                self.procs = []
                self.channel.pending = []
                with on_device(self.device):
                    self.transport.close()
