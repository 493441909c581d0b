"""LLMEngine: loads a model directory and steps requests: schedule -> execute -> update."""

from __future__ import annotations

import logging
import random
import time

import torch

from ..cache.kv_pool import KVPool, PoolExhausted
from ..cache.prefix import image_points
from ..cache.states import StateSlots
from ..config import ConfigError, ModelConfig
from ..engine_config import EngineConfig
from ..model.flash_next import FlashNext
from ..runtime.device_memory import cap_device_memory
from ..runtime.expert_cache import ExpertCache, slots_for_gib
from ..runtime.pipeline import PipelineRunner, build_stage
from ..runtime.runner import ChunkResult, LaunchedStep, ModelRunner
from ..runtime.windows import plain_greedy
from .concurrency import resolve_max_concurrency
from .detokenizer import Detokenizer
from .outputs import RequestOutput
from .penalties import TokenTally
from .preemption import Swapper
from .sampling import SamplingParams, TokenConstraint
from .scheduler import Scheduler, StepPlan
from .sequence import Sequence, Status
from .setup import (
    build_expert_cache,
    build_prefix,
    capture_graphs,
    check_kv_dtype,
    check_pipeline,
    check_state_memory,
    host_arena,
    kv_capacity,
    load_engine_model,
    load_tokenizer,
    make_proposer,
)
from .validate import check_prompt
from .warmup import use_compile_cache, warm_up

log = logging.getLogger("nextserve.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, model: FlashNext | None = None) -> None:
        """`model`: an already-built model (benchmarks build random weights on the device); by default
        the weights of `config.model`, a model directory."""
        t_start = time.perf_counter()
        self.config = config
        if config.compile_cache_dir is not None:
            use_compile_cache(config.compile_cache_dir)
        self.device, self.dtype = config.torch_device(), config.torch_dtype()
        check_kv_dtype(config, self.dtype, self.device)
        stages = config.pipeline_stages
        if model is None:
            self.model_config = cfg = ModelConfig.from_dir(config.model)
            self.tokenizer = None if config.skip_tokenizer else load_tokenizer(config.model)
        else:
            self.model_config, self.tokenizer = (cfg := model.cfg), None
        if config.max_context is not None and config.max_context > cfg.max_position_embeddings:
            raise ConfigError(
                f"max_context {config.max_context} exceeds the model's {cfg.max_position_embeddings} "
                "positions (max_position_embeddings in config.json); the model was not trained beyond them"
            )
        n_attn = len(cfg.qsa_layers) + 1  # the MTP layer's planes come last
        # keep slots per state slot for verify windows' rewinds (engine/speculative.py)
        steps = config.speculative_tokens if config.speculative_method != "off" else 0
        config = self.config = resolve_max_concurrency(config, cfg, self.device, self.dtype, steps, model)
        if stages > 1:
            ranges, devices = check_pipeline(config, cfg, self.device, model)
            self.device = devices[0]  # stage 0's, where the driver samples
        caps = config.stage_memory_caps()  # (stage 0's, the driver's; the stages cap their own)
        cap_device_memory(self.device, config.gpu_memory_gib if caps is None else caps[0])
        mtp, self.plan, self.expert_cache = None, None, None
        if stages == 1:
            # NOTE: the weights (the MTP block's too) and the state slots (with the keep slots of verify
            # windows: gigabytes at real widths) are in memory before the KV pool is sized from what is free;
            # the memory plan checks that they fit before any of them is read.
            self.model, mtp, self.plan = load_engine_model(config, cfg, self.device, self.dtype, steps, model)
            check_state_memory(config, cfg, self.device, self.dtype, n_attn, steps)
            self.slots = StateSlots(
                cfg, config.max_concurrency, n_attn, self.dtype, self.device, window_steps=steps
            )
            self.expert_cache = build_expert_cache(
                config, cfg, self.model, self.plan, self.device, self.dtype
            )
        stage_plan = (ranges, devices, steps) if stages > 1 else None
        capacity, images = kv_capacity(config, cfg, self.device, self.dtype, n_attn, stage_plan)
        self.max_context = min(config.max_context or cfg.max_position_embeddings, capacity)
        if config.max_context is not None and config.max_context > capacity:
            raise ConfigError(f"max_context {config.max_context} exceeds kv_capacity {capacity}")
        num_pages = -(-capacity // config.page_size)
        if stages > 1:
            self.model, self.pool, self.slots = build_stage(
                config.model, cfg, ranges[0], self.dtype, config.state_slots, num_pages, config.page_size,
                self.device, self.max_context, steps, config.quantization, config.experts == "host",
                config.kv_dtype,
            )  # fmt: skip
            if cache_slots := slots_for_gib(self.model, config.stage_expert_cache_gib()):
                self.expert_cache = ExpertCache(self.model, cache_slots, self.device)
        else:
            self.model.prepare(self.max_context)
            self.pool = KVPool(
                cfg, n_attn, num_pages, config.page_size, self.dtype, self.device, kv_dtype=config.kv_dtype
            )
            self.plan.kv_tokens, self.plan.prefix_images = capacity, images
        self.pool.host_arena = host_arena(config, self.pool)
        if self.plan is not None:
            self.plan.host_arena = self.pool.host_arena.nbytes if self.pool.host_arena is not None else 0
            log.info("%s", self.plan.table())
        self.prefix = build_prefix(config, self.pool, images)
        proposer = make_proposer(config)
        self.spec_drafted = self.spec_accepted = 0
        # the MTP row of a sequence's last committed token trails it (in one process or on the last stage)
        lag = int(config.speculative_method == "mtp")
        host_store = self.prefix.host if self.prefix is not None else None
        if self.pool.host_arena is not None and host_store is not None:
            self.pool.host_arena.reclaim = host_store.evict_lru  # prefix images make room first
        swapper = Swapper(self.pool, self.slots, lag, config.host_kv_mib * 2**20, host_store)
        lookahead = max(config.decode_groups, steps + 1) + 1
        if config.pipeline_windows:  # a guessed window's rows, and the MTP chain after them (2k + 1)
            lookahead += 2 * steps
        self.scheduler = Scheduler(
            self.pool, self.slots, config.prefill_chunk, config.max_pending, self.prefix, proposer,
            kv_lag=lag, swapper=swapper, lookahead=lookahead, prefill_chunks=config.prefill_chunks_per_step(),
            prefill_chunks_beside_decodes=config.prefill_chunks_with_decodes(),
            guess_windows=config.pipeline_windows,
        )  # fmt: skip
        if stages > 1:
            self.runner = PipelineRunner(
                config, self.model, self.pool, self.slots, ranges, devices, self.max_context
            )
            if self.prefix is not None and self.prefix.host is not None:
                self.runner.mirror.mirror_host(self.prefix)  # every stage moves its share of an image
            self.runner.mirror.mirror_host(swapper)  # and of a preempted sequence
        else:
            self.runner = ModelRunner(
                self.model, self.device, self.pool, self.slots, None, config.pdl,
                mtp=mtp, draft_tokens=config.speculative_tokens,
                max_rows=config.max_concurrency * (1 + steps),
            )  # fmt: skip
            if self.device.type == "cuda" and config.cuda_graph:  # (stages capture their own)
                capture_graphs(config, self.model, self.pool, self.slots, self.runner, self.max_context)
        self.sequences: dict[str, Sequence] = {}
        self._launched: LaunchedStep | None = None  # a decode step whose tokens the host has not read
        self._rng = random.Random(config.seed)
        self._next_id = 0
        if self.device.type == "cuda" and config.warm_up:
            warm_up(self)
        if self.expert_cache is not None:
            self.expert_cache.reset()  # (warm-up's random prompts teach the policy nothing)
        log.info("engine ready in %.1f s", time.perf_counter() - t_start)

    def reset_counters(self) -> None:
        """Zero the counters the stats report (after the warm-up: the engine starts as if nothing ran)."""
        self.spec_drafted = self.spec_accepted = 0
        self.scheduler.swapper.preemptions = self.scheduler.swapper.resumes = 0
        if isinstance(self.runner, PipelineRunner):
            self.runner.windows_held = self.runner.windows_dropped = 0
        if self.prefix is not None:
            self.prefix.host_hits = self.prefix.hits = self.prefix.misses = 0

    def close(self) -> None:
        """Stop what the engine started beside it (pipeline stage processes); idempotent."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer: pass prompts as token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False), prompt
        ids = list(prompt)
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise ValueError("a token-id prompt must be a list of integers")
        return ids, None

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        constraint: TokenConstraint | None = None,
        checkpoints: tuple[int, ...] = (),
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request. `checkpoints`: prompt positions (e.g. where the last message starts) to
        keep a prefix image at, on the last grid boundary at or before each (message checkpoints).
        `cache_salt`: prefix images are shared only between requests of the same salt (tenants)."""
        if (failure := self.failure()) is not None:
            raise RuntimeError(f"the engine cannot serve: {failure}")
        ids, text = check_prompt(self, prompt)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        gen = torch.Generator().manual_seed(
            params.seed if params.seed is not None else self._rng.getrandbits(63)
        )
        points = frozenset()
        if self.prefix is not None:
            points = image_points(
                len(ids), checkpoints, self.config.prefill_chunk, self.config.prefix_anchor_chunks
            )
        seq = Sequence(
            request_id,
            ids,
            params,
            self.max_context,
            prompt_text=text,
            generator=gen,
            constraint=constraint,
            detokenizer=Detokenizer(self.tokenizer) if self.tokenizer is not None else None,
            image_points=points,
            tally=TokenTally(ids, self.model_config.vocab_size) if params.penalized else None,
            salt=(cache_salt or "").encode("utf-8", "surrogatepass"),
        )
        self.scheduler.add(seq)
        self.sequences[request_id] = seq
        return request_id

    def _keep_image(self, seq: Sequence) -> None:
        """Snapshot a prefill that just ended on one of its image points (never a decoded state:
        a cold prefill computes those tokens differently, C1)."""
        tokens = seq.prompt_ids[: seq.num_computed]
        if seq.num_computed not in seq.image_points or not self.prefix.wants(tokens, seq.salt):
            return
        try:
            image = seq.cache.snapshot()
        except PoolExhausted:
            return  # an image is an optimisation; a full pool simply goes without
        self.prefix.insert(tokens, image, seq.salt)

    def abort(self, request_id: str) -> None:
        seq = self.sequences.get(request_id)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")

    def failure(self) -> str | None:
        """Why this engine cannot run steps any more (a pipeline stage died), or None."""
        return getattr(self.runner, "failure", None)

    def fail_all(self, error: str, deltas: bool = False) -> list[RequestOutput]:
        """End every unfinished request with `error` (a step that raised: no request may wait on a step
        that will raise again); their outputs."""
        seqs = [s for s in self.sequences.values() if not s.finished]
        for seq in seqs:
            self.scheduler.finish(seq, "error", error)
        return self.drain_finished(seqs, deltas)

    # ---- the step ------------------------------------------------------------------------------
    def step(self, deltas: bool = False) -> list[RequestOutput]:
        """One engine step; returns the requests that changed (finished ones are then forgotten): their
        whole outputs so far, or with `deltas` only the tokens each request has not handed out before
        (RequestOutput.offset says where they start).

        # NOTE: async scheduling. A step of plain greedy decodes is launched, then the host reads the
        # previous launched step's tokens while the GPU runs it: the GPU never waits for the host's
        # bookkeeping. A sequence's token still on the device is named by its row (Sequence.pending),
        # and resolved on the device. A sequence that the previous step finished (a stop token, a stop
        # string) has one wasted row in the step launched meanwhile: its token is dropped, and its slot
        # and pages are reused only by work queued after that step. Any other step first reads the
        # previous one's tokens and then runs as before, so the tokens are the same either way (C1)."""
        plan = self.scheduler.schedule()
        launched, self._launched = self._launched, None
        touched: list[Sequence] = []
        if self._overlaps(plan):
            touched += self._launch(plan.decodes)
            plan = StepPlan()
        if launched is not None:
            touched += self._collect(launched)
            plan = plan.running()  # without the chunks of sequences the collected tokens finished
        if not plan.empty:
            results = self.runner.execute(plan)
            self.update(results)
            touched += [c.seq for c in plan.chunks]
        if self.expert_cache is not None:
            self.expert_cache.step()
        return self.drain_finished(touched, deltas)

    def _overlaps(self, plan: StepPlan) -> bool:
        """Whether `plan` is launched without waiting for its tokens: plain greedy decodes only, in one
        process, not speculating."""
        return (
            self.config.async_scheduling
            and bool(plan.decodes)
            and not plan.prefills
            and not plan.verifies
            and self.config.pipeline_stages == 1
            and self.scheduler.proposer is None  # (the MTP drafter comes with its proposer)
            and all(plain_greedy(ch) for ch in plan.decodes)
        )

    def _launch(self, chunks: list) -> list[Sequence]:
        """Launch a decode step and count its rows computed (their tokens pending); the sequences that
        failed (C2: that step's only)."""
        try:
            self._launched = self.runner.launch_decode(chunks)
        except Exception as exc:  # noqa: BLE001 - those requests only
            return self._fail([ch.seq for ch in chunks], exc, "decode step")
        for b, ch in enumerate(chunks):
            ch.seq.num_computed = ch.seq.cache.length = ch.end
            ch.seq.pending.append(b)
        return []

    def _collect(self, launched: LaunchedStep) -> list[Sequence]:
        """Append a launched step's tokens to its sequences that still run."""
        seqs = [ch.seq for ch in launched.chunks]
        try:
            tokens = launched.tokens()
        except Exception as exc:  # noqa: BLE001 - that step's requests only
            return self._fail(seqs, exc, "decode step")
        for seq, token in zip(seqs, tokens, strict=True):
            if seq.finished:  # aborted, or finished by the step before, while this one ran
                continue
            seq.pending.pop(0)
            try:
                self._append(seq, token, None)
            except Exception as exc:  # noqa: BLE001
                self._fail([seq], exc, f"update of {seq.request_id}")
            if seq.finished:
                seq.pending.clear()
        return seqs

    def update(self, results: list[ChunkResult]) -> None:
        """Commit what each chunk computed. An error ends that chunk's request only (C2)."""
        for r in results:
            seq = r.chunk.seq
            if seq.finished:
                continue
            if r.error is not None:
                self.scheduler.finish(seq, "error", r.error)
                continue
            seq.num_computed = seq.cache.length = r.chunk.end if r.computed is None else r.computed
            seq.drafts = r.drafts
            if r.chunk.drafts:
                self.spec_drafted += len(r.chunk.drafts)
                self.spec_accepted += seq.num_computed - r.chunk.start - 1
            if self.prefix is not None and r.chunk.end <= len(seq.prompt_ids):
                self._keep_image(seq)
            if r.token is None:
                continue
            try:
                self._append(seq, r.token, r.logprob)
                for token, logprob in r.more:  # a verify window's further tokens, while seq runs
                    if seq.finished:
                        break
                    self._append(seq, token, logprob)
            except Exception as exc:  # noqa: BLE001 - e.g. a grammar that fails to accept
                self._fail([seq], exc, f"update of {seq.request_id}")

    def _fail(self, seqs: list[Sequence], exc: Exception, what: str) -> list[Sequence]:
        """End `seqs` with the error (C2: those requests only); returns them."""
        log.exception("%s failed", what)
        for seq in seqs:
            self.scheduler.finish(seq, "error", f"{type(exc).__name__}: {exc}")
        return seqs

    def _append(self, seq: Sequence, token: int, logprob) -> None:
        reason = seq.append(token, logprob, self.model_config.eos_token_id)
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def drain_finished(self, touched: list[Sequence], deltas: bool = False) -> list[RequestOutput]:
        """The outputs of `touched` and of every finished sequence (then forgotten); see `step`."""

        def output(seq: Sequence) -> RequestOutput:
            if not deltas:
                return RequestOutput.of(seq)
            out = RequestOutput.of(seq, since=seq.num_emitted)
            seq.num_emitted = len(seq.output_ids)
            return out

        outs = [output(s) for s in dict.fromkeys(touched)]
        for rid in [r for r, s in self.sequences.items() if s.finished and s.status is Status.FINISHED]:
            seq = self.sequences.pop(rid)
            if seq not in touched:
                outs.append(output(seq))
        return outs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self._launched is not None

    def clear_prefix_cache(self) -> None:
        """Drop every stored prefix image (their pages return to the pool unless a sequence uses them)."""
        if self.prefix is not None:
            self.prefix.clear()

    def stats(self) -> dict[str, int]:
        host = self.prefix.host if self.prefix is not None else None
        return {
            "prefix_images": len(self.prefix) if self.prefix is not None else 0,
            "host_images": len(host) if host is not None else 0,
            "host_image_hits": self.prefix.host_hits if self.prefix is not None else 0,
            "prefix_hits": self.prefix.hits if self.prefix is not None else 0,
            "prefix_misses": self.prefix.misses if self.prefix is not None else 0,
            "kv_pages_free": self.pool.num_free,
            "kv_pages_in_images": len(self.prefix.pages()) if self.prefix is not None else 0,
            "kv_pages_total": self.pool.num_pages,
            "state_slots_free": self.slots.num_free,
            "state_slots_total": self.config.max_concurrency,  # (not the pipeline windows' shadow slot)
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "spec_draft_tokens": self.spec_drafted,
            "spec_accepted_tokens": self.spec_accepted,
            "preemptions": self.scheduler.swapper.preemptions,
            "preempted_resumes": self.scheduler.swapper.resumes,
            "preempted_waiting": len(self.scheduler.swapper.copies),
            "pipeline_windows_held": getattr(self.runner, "windows_held", 0),
            "pipeline_windows_dropped": getattr(self.runner, "windows_dropped", 0),
        } | (self.expert_cache.stats() if self.expert_cache is not None else {})
