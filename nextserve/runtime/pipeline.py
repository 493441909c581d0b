"""Pipeline stages: the model's layers split into contiguous ranges, one process per stage, each on its
own device (the CPU, or a GPU per stage), activations passed stage to stage (DESIGN.md "Pipeline"). One
microbatch in flight: every stage runs each step's prefill chunks and decode batch in turn; on GPUs a
stage's decode steps and verify windows replay CUDA graphs of its layers (prefill chunks run eagerly).

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
import math
import subprocess
import time
from collections import deque
from dataclasses import dataclass

import torch

from ..cache.kv_pool import KVPool, kv_bytes_per_token
from ..cache.states import KindRange, StateSlots
from ..config import ConfigError, ModelConfig
from ..engine_config import EngineConfig
from ..model.flash_next import FlashNext
from ..model.loader import load_module, meta_device
from ..model.shapes import expected_shapes
from ..step_plan import Chunk, StepPlan
from .decode_rounds import DecodeRounds, DecodeRow
from .pipeline_windows import commit_location, guess_work, mtp_tokens, pair_chunk, sample_pair
from .runner import ChunkResult, _describe
from .stage_channel import free_port
from .stage_launch import StageSetup, start_stages
from .stage_mirror import StageMirror
from .stage_mtp import mtp_work, receive_drafts
from .stage_transport import make_transport
from .stage_worker import DecodeWork, PrefillWork, StageStep, StageWorker, WindowsWork, on_device

EXPERTS = ".mlp.experts."  # in the runtime names of routed expert stacks
log = logging.getLogger("nextserve.pipeline")
FAILED = "RuntimeError: the forward failed in a pipeline stage (its log has the traceback)"


class _StagesDown(Exception):
    """The channel failed while a step waited on a guessed window (raised on as its cause)."""


def stage_layers(num_layers: int, stages: int, counts: list[int] | None = None) -> list[range]:
    """Contiguous layer ranges: `counts` layers each (the last stage keeps the head), or as even as can be
    (the first stages take one more)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{stages} stages for {num_layers} layers")
    if counts is None:
        size, extra = divmod(num_layers, stages)
        counts = [size + (s < extra) for s in range(stages)]
    if len(counts) != stages or min(counts) < 1 or sum(counts) != num_layers:
        raise ValueError(f"stage layer counts {counts} for {stages} stages of {num_layers} layers")
    bounds = [0]
    for n in counts:
        bounds.append(bounds[-1] + n)
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def build_stage(
    model_dir: str, cfg: ModelConfig, layers: range, dtype: torch.dtype, num_slots: int, num_pages: int,
    page_size: int, device: torch.device | str = "cpu", max_context: int | None = None, window_steps: int = 0,
    quantization: str = "auto", experts_host: bool = False, kv_dtype: str = "auto",
) -> tuple[FlashNext, KVPool, StateSlots]:  # fmt: skip
    """One stage's layers (with their weights only; with `experts_host` its routed experts in pinned host
    memory on a GPU), state slots (with `window_steps` keep slots each: the speculative tokens per verify
    window) and KV pool (of `kv_dtype`)."""
    last = layers.stop == cfg.num_hidden_layers
    with meta_device():
        model = FlashNext(cfg, layers)
    host = frozenset(n for n in expected_shapes(cfg) if EXPERTS in n and in_stage(n, layers, cfg))
    load_module(
        model, model_dir, cfg, dtype, torch.device(device), layers=layers, with_embed=layers.start == 0,
        with_head=last, quantization=quantization, host=host if experts_host else frozenset(),
    )  # fmt: skip
    model.eval().prepare(max_context)
    kinds = KindRange.of(cfg, layers)
    slots = StateSlots(cfg, num_slots, len(kinds.attn), dtype, device, kinds=kinds, window_steps=window_steps)
    first = kinds.attn.start
    pool = KVPool(
        cfg, len(kinds.attn), num_pages, page_size, dtype, device, first_attn=first, kv_dtype=kv_dtype
    )
    return model, pool, slots


def in_stage(name: str, layers: range, cfg: ModelConfig) -> bool:
    """Whether checkpoint tensor `name` (the loader's runtime names) belongs to the stage of `layers`."""
    if name.startswith("layers."):
        return int(name.split(".")[1]) in layers
    if name.startswith("embed_tokens."):
        return layers.start == 0
    return layers.stop == cfg.num_hidden_layers  # the mixer, lm_head and the MTP block


@dataclass(frozen=True)
class StageNeeds:
    """What every stage's GPU must hold besides its KV planes, for --kv-capacity auto: its layers' weights
    and its state slots (`window_steps` keep slots each); the last stage's MTP block with `mtp`, and its
    copy of the token embeddings unless they are in host memory (`head_embedding`)."""

    cfg: ModelConfig
    dtype: torch.dtype
    num_slots: int
    window_steps: int
    mtp: bool = False
    head_embedding: str = "device"
    held: dict[str, int] | None = None  # each tensor's bytes as loaded (memory_plan.held_tensor_bytes)
    experts_host: bool = False  # the routed experts in host memory: none of their bytes on the GPU
    expert_cache_gib: float = 0.0  # each stage's device cache of them
    kv_dtype: str = "auto"  # the KV planes' form (ops/kv8.py)

    def bytes_and_kv_per_token(self, layers: range) -> tuple[int, int]:
        """(bytes of the stage's weights and state slots, bytes per token of its KV planes). Weights count as
        `held` says (FP8 and int4 ones as they are held), else in the model dtype."""
        cfg, kinds = self.cfg, KindRange.of(self.cfg, layers)
        elem = torch.empty((), dtype=self.dtype).element_size()
        shapes = expected_shapes(cfg, with_mtp=self.mtp)
        held = self.held or {}

        def size(name: str) -> int:
            if self.experts_host and EXPERTS in name and name.startswith("layers."):
                return 0
            return held.get(name, math.prod(shapes[name]) * elem)

        weights = sum(size(name) for name in shapes if in_stage(name, layers, cfg))
        if self.mtp and self.head_embedding == "device" and layers.stop == cfg.num_hidden_layers:
            weights += math.prod(shapes["embed_tokens.weight"]) * elem
        slots = StateSlots.slot_bytes(cfg, kinds, self.dtype) * (1 + self.num_slots * (1 + self.window_steps))
        cache = int(self.expert_cache_gib * 2**30)
        return weights + slots + cache, kv_bytes_per_token(cfg, len(kinds.attn), self.dtype, self.kv_dtype)

    def kv_tokens(
        self, ranges: list[range], devices: list[torch.device], headroom: int, caps: list[float] | None = None
    ) -> int:
        """The KV tokens every stage's GPU holds besides its stages' needs (the pool is the same size in
        every stage): the least over the GPUs, sized before any stage loads; with `caps` (GiB a stage,
        --stage-memory-gib) also the least over the stages of what each one's cap holds. A stage whose
        needs pass its cap is a ConfigError naming it.

        # NOTE: the free memory of stage 0's GPU only (reading another's would open a CUDA context on it
        # from the driver); the other GPUs are taken to have as much free."""
        fits = []
        for rank, (layers, cap) in enumerate(zip(ranges, caps or [], strict=False)):
            need, per_token = self.bytes_and_kv_per_token(layers)
            room = int(cap * 2**30) - headroom - need
            if room < per_token:
                raise ConfigError(
                    f"pipeline stage {rank} (layers {layers.start}-{layers.stop - 1}) needs "
                    f"{(need + headroom) / 2**30:.1f} GiB and its cap is {cap:g} GiB: give it fewer layers "
                    "(--stage-layers), a bigger cap (--stage-memory-gib), --quantization int4 or fp8, or a "
                    "lower --max-concurrency"
                )
            fits.append(room // per_token)
        free, _ = torch.cuda.mem_get_info(devices[0])
        per_device: dict[torch.device, list[int]] = {}  # device -> [bytes needed, KV bytes per token]
        for layers, dev in zip(ranges, devices, strict=True):
            need, per_token = self.bytes_and_kv_per_token(layers)
            total = per_device.setdefault(dev, [0, 0])
            total[0] += need
            total[1] += per_token
        on_devices = min((free - headroom - need) // per_token for need, per_token in per_device.values())
        return min([on_devices, *fits])


class PipelineRunner(StageWorker):
    """Stage 0 and the driver: sends each step to the stages, runs stage 0's share, receives the last stage's
    logits and samples them (the single-device runner's sampling)."""

    def __init__(
        self, config: EngineConfig, model: FlashNext, pool: KVPool, slots: StateSlots, stages: list[range],
        devices: list[torch.device], max_context: int,
    ) -> None:  # fmt: skip
        cfg, dtype, kind = model.cfg, pool.dtype, config.stage_transport_kind()
        caps = config.stage_memory_caps()
        port = free_port()
        arena_mib = pool.host_arena.nbytes >> 20 if pool.host_arena is not None else 0
        setups = [
            StageSetup(config.model, cfg, stages[rank], dtype, slots.num_slots, pool.num_pages,
                       pool.page_size, rank, len(stages), port, torch.get_num_threads(), str(devices[rank]),
                       kind, config.pdl, max_context, config.cuda_graph, slots.window_steps,
                       config.quantization, mtp_tokens(config), config.head_embedding, arena_mib,
                       None if caps is None else caps[rank], config.experts == "host",
                       config.stage_expert_cache_gib(), config.kv_dtype)
            for rank in range(1, len(stages))
        ]  # fmt: skip
        channel, self.procs = start_stages(setups, port)
        try:
            with on_device(devices[0]):
                transport = make_transport(kind, channel, devices[0])
        except BaseException:  # no stage is left waiting for a driver that is not coming
            for proc in self.procs:
                proc.kill()
            raise
        super().__init__(model, pool, slots, channel, transport, devices[0], config.pdl)
        if config.cuda_graph and devices[0].type == "cuda":
            with on_device(devices[0]):
                self.capture_graphs(pool.pages_for(max_context), slots.num_slots, slots.window_steps)
        self.mirror = StageMirror(pool, slots)
        self.decode_groups = config.decode_groups
        self.mtp_tokens = mtp_tokens(config)  # the last stage drafts up to this many (0: no MTP)
        # --pipeline-windows: the slot guessed windows run on (every stage's, taken from the free list)
        self.shadow = slots.alloc() if config.pipeline_windows else None
        self.windows_held = self.windows_dropped = 0  # guessed windows committed / dropped
        self.failure: str | None = None  # why the pipeline cannot run (a stage died), for good
        self.closed = False
        self.channel.broadcast(None)  # every stage is built
        self.dtype = dtype

    def execute(self, plan: StepPlan) -> list[ChunkResult]:
        """The step's results. A stage that died or stopped answering (a raise from the channel: Gloo
        reports a closed peer at once) breaks the pipeline for good: the step's chunks and every later
        step's fail with `failure`, without talking to the stages again (C2: nothing hangs or loops).

        # NOTE: an item's own forward failing is not this: it is passed on marked failed and the
        # stages stay in step (`_receive`'s ok flag)."""
        if self.failure is None:
            try:
                with on_device(self.device):
                    return self._drive(plan)
            except Exception as exc:  # noqa: BLE001 - the stages are out of step: no step can run
                self.failure = self._describe_failure(exc)
                log.error("%s: failing every request", self.failure)
        return [ChunkResult(ch, error=self.failure) for ch in plan.chunks]

    def _describe_failure(self, exc: Exception) -> str:
        """Which stage is gone (its exit code), or else what the channel said."""
        time.sleep(0.2)  # a killed stage's exit is seen by poll() a moment after its sockets close
        gone = [(rank, p.poll()) for rank, p in enumerate(self.procs, start=1) if p.poll() is not None]
        if gone:
            return "; ".join(f"pipeline stage {rank} exited (code {code})" for rank, code in gone)
        return f"pipeline stages stopped answering: {type(exc).__name__}: {str(exc)[:200]}"

    def _launch(self, step: StageStep) -> None:
        """Send a step to every stage and run stage 0's share of it (its items then travel on)."""
        self.channel.send_step(step)
        self.run(step, self.dtype)

    def _drive(self, plan: StepPlan) -> list[ChunkResult]:
        """Launch the step's items, then take back what the last stage returns, in launch order: the verify
        windows (one item; a rejected draft's rewind goes to the stages with the next step's ops), prefill
        chunks, and decode groups (each group's next round launched as soon as its tokens are sampled)."""
        prefills = [
            PrefillWork(ch.seq.cache.slot, list(ch.seq.cache.block_table), ch.start,
                        ch.seq.tokens(ch.start, ch.end), ch.sample)
            for ch in plan.prefills
        ]  # fmt: skip
        windows, W = None, 1 + max((len(ch.drafts) for ch in plan.verifies), default=0)
        if plan.verifies:  # pages owned (copy-on-write) before the step's ops are taken
            inputs, tables = self.window_inputs(plan.verifies, W)
            windows = WindowsWork(inputs, [list(t) for t in tables])
        rounds = DecodeRounds(plan.decodes, self.decode_groups, self.model.cfg.eos_token_id)
        decodes = [self._decode_work(rows) for rows in rounds.groups]
        guess = None  # the guessed next window of a sequence verifying alone (pipeline_windows.py)
        if self.shadow is not None and len(plan.verifies) == 1 and plan.verifies[0].guess:
            guess = guess_work(plan.verifies[0], self.shadow, self.states)
        self._launch(StageStep(self.mirror.take(), prefills, tuple(decodes), windows, guess=guess))
        # NOTE: every stage runs items in launch order and the last stage returns them in that order
        queue = deque([("windows", plan.verifies, W * len(plan.verifies))] if plan.verifies else [])
        queue += [("prefill", ch, int(ch.sample)) for ch in plan.prefills]
        queue += [("decode", rows, len(rows)) for rows in rounds.groups]
        results, rows, chunks = [], [], []
        with torch.inference_mode():
            while queue:
                kind, item, n_rows = queue.popleft()
                ok, logits = self._receive(n_rows)
                if kind == "windows" and guess is not None:
                    results.append(self._resolve_pair(item[0], ok, logits, guess.slot))
                elif kind == "windows":
                    if not ok:
                        results += [self._failed(ch) for ch in item]
                    else:  # rewinds: this stage's now, the others' as an op of the next step (StageMirror)
                        results += self.resolve_windows(item, logits.view(W, len(item), -1), None)
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
        if chunks:
            try:
                results += self._sample(chunks, [(torch.cat(rows), None)])
            except Exception as exc:  # noqa: BLE001
                log.exception("sampling failed")
                results += [ChunkResult(ch, error=_describe(exc)) for ch in chunks]
        if self.mtp_tokens and (plan.prefills or plan.verifies):
            self._draft(plan, results)
        return results

    def _resolve_pair(self, ch: Chunk, ok: bool, logits: torch.Tensor | None, slot: int) -> ChunkResult:
        """The result of `ch`'s verify window and, when it all held, of its guessed window too, which the
        last stage computes only once told so here (pipeline_windows.py); the state after the last
        committed row goes to the sequence's slot (a rewind, mirrored to every stage)."""
        last, asked = self.channel.world - 1, False

        def guessed_rows() -> torch.Tensor:
            nonlocal asked
            asked = True
            try:
                self.channel.send(torch.ones(1, dtype=torch.int8), last)
                ok_guess, rows = self._receive(len(ch.guess))
            except Exception as exc:
                raise _StagesDown from exc
            if not ok_guess:
                raise RuntimeError(FAILED)
            return rows

        try:
            if not ok:
                return self._failed(ch)
            rows, held = sample_pair(ch, logits, guessed_rows, self.model.cfg.eos_token_id)
        except _StagesDown as down:  # the stages are out of step: `execute`'s failure, not this request's
            raise down.__cause__ from None
        except Exception as exc:  # noqa: BLE001 - that request only (C2)
            log.exception("verify window with a guess failed")
            return ChunkResult(ch, error=_describe(exc))
        finally:
            if not asked:  # the last stage drops the guessed window's streams
                self.channel.send(torch.zeros(1, dtype=torch.int8), last)
        self.windows_held += held
        self.windows_dropped += not held
        W, n_kept = 1 + len(ch.drafts), len(rows)
        kept = commit_location(self.states, slot, self.shadow, W, len(ch.guess), n_kept)
        if kept != slot:
            self.states.rewind([kept], [slot])
        (token, lp), more = rows[0], rows[1:]
        return ChunkResult(pair_chunk(ch) if held else ch, token, lp, more=more, computed=ch.start + n_kept)

    def _draft(self, plan: StepPlan, results: list[ChunkResult]) -> None:
        """The MTP drafts of the step's committed chunks, drafted on the last stage (stage_mtp.py).

        # NOTE: sent whenever the step had chunks the last stage kept streams of (even with none left to
        # draft for), so that every MTP message takes exactly the streams of the step before it."""
        work, owners = mtp_work(plan, results, self.mtp_tokens)
        self._launch(StageStep(self.mirror.take(), [], mtp=work))
        receive_drafts(self.channel, owners, work, self.mtp_tokens)
        self.flush()

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

    def close(self) -> None:
        """Stop the stage processes (idempotent); after a failure, the ones still alive are killed (they
        wait on a pipeline that will not move again). torchrun's ranks (no processes of ours) each answer
        that they took the stop, so the driver does not tear the store down under them."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.failure is None:
                self.channel.send_step(None)  # not waited for: a stage already gone never takes it
                if not self.procs:
                    for rank in range(1, self.channel.world):
                        self.channel.recv((1,), torch.int8, rank)
        except RuntimeError as exc:  # a stage already gone: stop the others anyway
            log.warning("pipeline stages did not all take the stop: %s", exc)
        finally:
            for proc in self.procs:
                try:
                    proc.wait(timeout=30 if self.failure is None else 0.5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self.procs = []
            self.channel.pending = []
            with on_device(self.device):
                self.transport.close()
