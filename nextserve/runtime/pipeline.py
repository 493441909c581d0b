"""Pipeline stages: the model's layers split into contiguous ranges, one process per stage, each on its
own device (the CPU, or a GPU per stage), activations passed stage to stage (DESIGN.md "Pipeline"). One
microbatch in flight: every stage runs each step's prefill chunks and decode batch in turn, decode
eagerly (no CUDA graphs in stages yet).

# NOTE: the engine process is stage 0 and the driver: its scheduler allocates state slots and KV pages
# for every stage, since each stage holds its own layers' planes of the same sizes, indexed alike. A
# step is broadcast as a `StageStep` (each chunk's slot, block table, positions and token ids); every
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
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache.kv_pool import KVPool
from ..cache.states import KindRange, StateSlots
from ..config import EngineConfig, ModelConfig
from ..engine.sampling import sample_row
from ..engine.scheduler import StepPlan
from ..model.flash_next import FlashNext
from ..model.loader import load_weights
from .runner import ChunkResult, _describe
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


class PipelineRunner(StageWorker):
    """Stage 0 and the driver: broadcasts each step, runs stage 0's share, receives the last stage's
    logits and samples them (the single-device runner's sampling)."""

    def __init__(
        self, config: EngineConfig, model: FlashNext, pool: KVPool, slots: StateSlots, stages: list[range],
        devices: list[torch.device],
    ) -> None:  # fmt: skip
        port = free_port()
        cfg, dtype, kind = model.cfg, pool.k.dtype, config.stage_transport_kind()
        self.procs: list[subprocess.Popen] = []
        # NOTE: `python -m` children, not multiprocessing's spawn, which would re-run the user's main
        # module in every stage.
        for rank in range(1, len(stages)):
            setup = StageSetup(config.model, cfg, stages[rank], dtype, slots.num_slots, pool.num_pages,
                               pool.page_size, rank, len(stages), port, torch.get_num_threads(),
                               str(devices[rank]), kind, config.pdl)  # fmt: skip
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
        self.channel.broadcast(None)  # every stage is built
        self.dtype = dtype

    def execute(self, plan: StepPlan) -> list[ChunkResult]:
        with on_device(self.device):
            return self._drive(plan)

    def _drive(self, plan: StepPlan) -> list[ChunkResult]:
        prefills = [
            PrefillWork(ch.seq.cache.slot, list(ch.seq.cache.block_table), ch.start,
                        ch.seq.tokens(ch.start, ch.end), ch.sample)
            for ch in plan.prefills
        ]  # fmt: skip
        decode = None
        if plan.decodes:
            ids, positions, slots, tables = self.decode_inputs(plan.decodes)
            decode = DecodeWork(ids, positions, slots, [list(t) for t in tables])
        windows = []
        for ch in plan.verifies:
            for p in range(ch.start, ch.end):
                ch.seq.cache.own_page_at(p)  # copy-on-write before the step's ops are taken
            ids = [ch.seq.token_at(ch.start), *ch.drafts]
            windows.append(WindowWork(ch.seq.cache.slot, list(ch.seq.cache.block_table), ch.start, ids))
        step = StageStep(self.mirror.take(), prefills, decode, tuple(windows))
        self.channel.broadcast(step)
        self.run(step, self.dtype)
        rows, chunks, results = [], [], []
        # NOTE: items come back in the order every stage runs them: windows, prefill chunks, the decode
        items = [([ch], len(w.ids)) for ch, w in zip(plan.verifies, windows, strict=True)]
        items += [([ch], 1 if ch.sample else 0) for ch in plan.prefills]
        items += [(plan.decodes, len(plan.decodes))] if plan.decodes else []
        window_logits = {}
        with torch.inference_mode():
            for item, n_rows in items:
                ok, logits = self._receive(n_rows)
                if not ok:
                    results += [ChunkResult(ch, error=FAILED) for ch in item]
                elif item[0] in plan.verifies:
                    window_logits[id(item[0])] = logits
                elif n_rows:
                    rows.append(logits)
                    chunks += item
                else:
                    results += [ChunkResult(ch) for ch in item]
        self.flush()
        results += self._verify_windows(plan.verifies, windows, window_logits)
        if not chunks:
            return results
        try:
            return results + self._sample(chunks, [(torch.cat(rows), None)])
        except Exception as exc:  # noqa: BLE001
            log.exception("sampling failed")
            return results + [ChunkResult(ch, error=_describe(exc)) for ch in chunks]

    def _receive(self, n_rows: int) -> tuple[bool, torch.Tensor | None]:
        """One item's status from the last stage, and its n_rows logits rows (none: n_rows == 0)."""
        last = self.channel.world - 1
        ok = bool(self.channel.recv((1,), torch.int8, last)[0])
        V = self.model.cfg.vocab_size
        return ok, self.transport.recv((n_rows, V), self.dtype, last) if n_rows else None

    def _verify_windows(self, chunks, windows: list[WindowWork], logits: dict) -> list[ChunkResult]:
        """Sample each window's rows in order until one differs from its draft (ModelRunner._verify's
        rule); windows with a rejected draft are rewound in every stage by a second step (the state
        from before the window restored, the committed rows run again)."""
        results, rewinds, rewound = [], [], []
        for ch, w in zip(chunks, windows, strict=True):
            if id(ch) not in logits:
                continue  # failed in a stage: reported already
            seq, sampled = ch.seq, []
            try:
                for j in range(len(w.ids)):
                    sampled.append(sample_row(logits[id(ch)][j], seq.params, seq.generator))
                    if j == len(ch.drafts) or sampled[-1][0] != ch.drafts[j]:
                        break
            except Exception as exc:  # noqa: BLE001 - that request only (C2)
                log.exception("sampling a verify window failed")
                results.append(ChunkResult(ch, error=_describe(exc)))
                continue
            kept = len(sampled)
            (token, lp), more = sampled[0], sampled[1:]
            result = ChunkResult(ch, token, lp, more=more, computed=ch.start + kept)
            if kept < len(w.ids):
                rewinds.append(RewindWork(w.slot, w.table, w.start, w.ids[:kept]))
                rewound.append(result)
            else:
                results.append(result)
        if not rewinds:
            return results
        step = StageStep(self.mirror.take(), [], None, (), tuple(rewinds))
        self.channel.broadcast(step)
        self.run(step, self.dtype)
        with torch.inference_mode():
            for result in rewound:
                ok, _ = self._receive(0)
                results.append(result if ok else ChunkResult(result.chunk, error=FAILED))
        self.flush()
        return results

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
                with on_device(self.device):
                    self.transport.close()
