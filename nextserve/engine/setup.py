"""How an LLMEngine is set up: its tokenizer and weights, the checks of what fits (pipeline stages, state
slots) and the KV pool's size, and the CUDA graphs it captures (engine/engine.py)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..cache.host_store import HostImageStore
from ..cache.kv_pool import KVPool, kv_bytes_per_token
from ..cache.pinned_arena import PinnedArena
from ..cache.prefix import PrefixCache
from ..cache.states import KindRange, StateSlots
from ..config import ConfigError, ModelConfig
from ..engine_config import EngineConfig
from ..model.flash_next import FlashNext
from ..model.loader import check_readable, load_module, meta_device
from ..model.mtp import MTP
from ..ops.pdl import pdl_mode
from ..runtime.device_memory import free_bytes
from ..runtime.expert_cache import ExpertCache, cache_slots
from ..runtime.graph_runner import GraphRunner
from ..runtime.mtp_runner import load_mtp
from ..runtime.pipeline import StageNeeds, stage_layers
from ..runtime.runner import ModelRunner
from ..runtime.stage_launch import torchrun_rank
from .memory_plan import MemoryPlan, headroom_bytes, held_tensor_bytes, module_bytes, plan_memory, state_plan
from .speculative import MtpProposer, NgramProposer

log = logging.getLogger("nextserve.engine")


def has_tokenizer(model_dir: str | Path) -> bool:
    d = Path(model_dir)
    return (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()


def load_tokenizer(model_dir: str | Path):
    """The directory's tokenizer (and chat template), or None when it ships none."""
    if not has_tokenizer(model_dir):
        return None
    from transformers import PreTrainedTokenizerFast

    # NOTE: not AutoTokenizer: it also parses config.json, and transformers releases disagree on
    # qwen4_exp layer-type names (5.17 rejects a 5.23 config), which must not stop a tokenizer load.
    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))


def load_model(config: EngineConfig, cfg: ModelConfig, host: frozenset[str] = frozenset()) -> FlashNext:
    """The directory's weights in a FlashNext on the configured device and dtype (FP8 projections and
    experts as the checkpoint or --quantization has them: model/loader.py), the runtime names in `host`
    in pinned host memory (engine/memory_plan.py)."""
    device, dtype = config.torch_device(), config.torch_dtype()
    with meta_device():
        model = FlashNext(cfg)
    load_module(model, config.model, cfg, dtype, device, quantization=config.quantization, host=host)
    return model.eval()


def load_engine_model(
    config: EngineConfig, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, steps: int,
    model: FlashNext | None,
) -> tuple[FlashNext, MTP | None, MemoryPlan]:  # fmt: skip
    """A one-process engine's model (config.model's weights, or `model` as given), its MTP block with
    --speculative-method mtp, and the memory plan (checked before any weight is read; the weights'
    figures then those the loaded modules hold)."""
    mtp_wanted = config.speculative_method == "mtp"
    if model is not None:
        if mtp_wanted:
            raise ConfigError("speculative_method mtp loads the MTP block from --model; pass no model")
        plan = state_plan(config, cfg, device, dtype, steps)
        plan.weights = module_bytes(model)
        return model.eval(), None, plan
    plan = plan_memory(config, cfg, device, dtype, steps, with_mtp=mtp_wanted)
    model = load_model(config, cfg, plan.host)
    mtp = load_mtp(config.model, cfg, dtype, device, config.quantization) if mtp_wanted else None  # or error
    plan.weights = module_bytes(model) | ({} if mtp is None else module_bytes(mtp, "mtp."))
    return model, mtp, plan


def build_expert_cache(
    config: EngineConfig, cfg: ModelConfig, model: FlashNext, plan: MemoryPlan, device: torch.device,
    dtype: torch.dtype,
) -> ExpertCache | None:  # fmt: skip
    """The device cache of the routed experts held in host memory (runtime/expert_cache.py), sized before
    the KV pool (which takes what it leaves), or None: experts on the device, or a size of no expert. On the
    CPU backend, whose host is its device, --experts host with --expert-cache-gib runs the mechanism alone
    (tests)."""
    on_host = plan.weights.get(("experts", "host"), 0) > 0
    if not on_host and not (device.type == "cpu" and config.experts == "host"):
        return None
    n_attn = len(cfg.qsa_layers) + 1
    context = config.max_context or cfg.max_position_embeddings
    per_token = kv_bytes_per_token(cfg, n_attn, dtype, config.kv_dtype)
    reserve = headroom_bytes(config, cfg, dtype) + context * per_token
    slots = cache_slots(config, model, device, reserve)
    if slots == 0:
        log.info("routed experts in host memory, no device expert cache (--expert-cache-gib)")
        return None
    cache = ExpertCache(model, slots, device)
    plan.expert_cache = (slots, len(cache.layers), cache.nbytes)
    return cache


def capture_graphs(
    config: EngineConfig,
    model: FlashNext,
    pool: KVPool,
    slots: StateSlots,
    runner: ModelRunner,
    max_context: int,
) -> None:
    """Capture the decode steps, verify windows and MTP drafter windows (runtime/graph_runner.py)."""
    c = config
    graphs = GraphRunner(
        model, pool, slots, pool.pages_for(max_context), c.max_concurrency,
        max_drafts=c.speculative_tokens if c.speculative_method != "off" else 0, drafter=runner.drafter,
        tokens=runner.tokens,
    )  # fmt: skip
    with pdl_mode(c.pdl):  # the graphs hold the launches as captured
        graphs.capture()
    runner.graphs = graphs
    if runner.drafter is not None:
        runner.drafter.graphs = graphs


def check_pipeline(
    config: EngineConfig, cfg: ModelConfig, device: torch.device, model: FlashNext | None
) -> tuple[list[range], list[torch.device]]:
    """The stages' layer ranges and devices, or a ConfigError for what pipelines do not run (yet)."""
    c, L = config, cfg.num_hidden_layers
    if model is not None:
        raise ConfigError("pipeline stages load their own layers' weights from --model")
    if c.speculative_method == "mtp":  # before any stage starts: the last one loads the MTP block
        check_readable(c.model, cfg, range(0), False, False, True)
    if c.pipeline_stages > L:
        raise ConfigError(f"pipeline_stages {c.pipeline_stages} exceeds the model's {L} layers")
    devices = c.stage_devices()
    if device.type == "cpu":
        if c.stage_transport == "nccl" or c.pipeline_devices is not None:
            raise ConfigError(
                "on the CPU backend pipeline stages talk over Gloo (stage_transport host), with no "
                "pipeline_devices: those are for CUDA devices"
            )
    elif device.type == "cuda":
        count = torch.cuda.device_count()
        # (under torchrun each rank takes its own machine's GPU of its local rank: stage_launch.py)
        if torchrun_rank() is None and any(d.index >= count for d in devices):
            raise ConfigError(
                f"pipeline stages on {', '.join(map(str, devices))}, but this machine has {count} "
                "CUDA devices (see --pipeline-devices)"
            )
        if c.stage_transport_kind() == "nccl" and not torch.distributed.is_nccl_available():
            raise ConfigError("this torch build has no NCCL: use --stage-transport host")
    else:
        raise ConfigError(f"pipeline stages run on the CPU or on CUDA devices, not {device.type}")
    counts = c.stage_layer_counts(L)
    if counts is not None and sum(counts) != L:
        raise ConfigError(
            f"stage_layers {c.stage_layers} sums to {sum(counts)} layers, the model has {L}: the counts must "
            "add up to the model's layers"
        )
    return stage_layers(L, c.pipeline_stages, counts), devices


def check_kv_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> None:
    """--kv-dtype against the model dtype and the GPUs: bf16 only where it is bfloat16 (auto keeps any); fp8
    only on GPUs of sm_89 or newer (the kernels convert E4M3 codes in hardware), every stage's."""
    if config.kv_dtype == "bf16" and dtype != torch.bfloat16:
        raise ConfigError(f"kv_dtype bf16 keeps the model dtype, which is {dtype}: say auto")
    if config.kv_dtype != "fp8" or device.type != "cuda":
        return
    indices = [device.index or 0]
    if config.pipeline_devices is not None:
        indices = [int(i) for i in str(config.pipeline_devices).split(",")]
    for i in indices:
        if torch.cuda.get_device_capability(i) < (8, 9):
            raise ConfigError(
                f"kv_dtype fp8 needs a GPU of sm_89 or newer (E4M3 conversions); cuda:{i} is "
                f"sm_{''.join(map(str, torch.cuda.get_device_capability(i)))}: use --kv-dtype int8"
            )


def check_state_memory(
    config: EngineConfig, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, n_attn: int, steps: int
) -> None:
    """A ConfigError, not an out-of-memory error, when the state slots do not fit on the GPU."""
    if device.type != "cuda":
        return
    c = config
    kinds = KindRange(range(len(cfg.gdn_layers)), range(len(cfg.ple_layers)), range(n_attn))
    need = StateSlots.slot_bytes(cfg, kinds, dtype) * (1 + c.max_concurrency * (1 + steps))
    free = free_bytes(device, c.gpu_memory_gib)
    if need > free - c.memory_headroom_mib * 2**20:
        raise ConfigError(
            f"the state slots need {need / 2**20:.0f} MiB ({c.max_concurrency} sequences"
            + (f", {steps} keep slots each for speculative_tokens" if steps else "")
            + f") and {free / 2**20:.0f} MiB are free; lower --max-concurrency"
            + (" or --speculative-tokens" if steps else "")
        )


IMAGE_SHARE = 8  # auto prefix images' state copies take at most 1/8 of the KV pool's memory
MAX_AUTO_IMAGES = 64
AUTO_HOST_IMAGES = 64


def kv_capacity(
    config: EngineConfig,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    n_attn: int,
    stages: tuple | None = None,
) -> tuple[int, int]:
    """(tokens of the KV pool, prefix images to keep): kv_capacity, or with "auto" what the free memory
    holds (on the CPU, cpu_kv_budget_mib). `stages`: (layer ranges, devices, keep slots per slot) of
    pipeline stages, whose weights and state slots are not loaded yet (stage_kv_tokens).

    # NOTE: an image holds a copy of a state slot beside the pool (its pages are the pool's, shared): with
    # --prefix-cache-images auto the copies get at most 1/IMAGE_SHARE of the pool's memory, taken out of
    # the pool when its size is auto, never added on top of it."""
    per_token = kv_bytes_per_token(cfg, n_attn, dtype, config.kv_dtype)
    slot = StateSlots.slot_bytes(cfg, KindRange.of(cfg), dtype)
    cap = config.kv_capacity
    if cap != "auto":
        return int(cap), prefix_images(config, int(cap) * per_token, slot)
    headroom = headroom_bytes(config, cfg, dtype)
    if device.type == "cuda" and stages is not None:
        ranges, devices, steps = stages
        mtp = config.speculative_method == "mtp"
        held = held_tensor_bytes(config, cfg, device, dtype, mtp)
        need = StageNeeds(
            cfg,
            dtype,
            config.state_slots,
            steps,
            mtp,
            config.head_embedding,
            held,
            config.experts == "host",
            config.stage_expert_cache_gib(),
            config.kv_dtype,
        )
        caps = config.stage_memory_caps()
        images = prefix_images(config, need.kv_tokens(ranges, devices, headroom, caps) * per_token, slot)
        tokens = need.kv_tokens(ranges, devices, headroom + images * slot, caps)
    else:
        if device.type == "cuda":  # one process: the weights and slots are in already
            budget = free_bytes(device, config.gpu_memory_gib) - headroom
        else:
            budget = config.cpu_kv_budget_mib * 2**20
        images = prefix_images(config, budget, slot)
        tokens = (budget - images * slot) // per_token
    if tokens < config.page_size:
        raise ConfigError(
            "not enough memory for the KV pool; lower --memory-headroom-mib or set --kv-capacity"
        )
    return int(min(tokens, config.max_concurrency * cfg.max_position_embeddings)), images


def prefix_images(config: EngineConfig, pool_bytes: int, slot_bytes: int) -> int:
    """--prefix-cache-images resolved: 0 with --no-prefix-cache; auto: what 1/IMAGE_SHARE of the pool's
    bytes holds in state copies, 1 to MAX_AUTO_IMAGES."""
    if not config.prefix_cache:
        return 0
    if config.prefix_cache_images != "auto":
        return int(config.prefix_cache_images)
    return int(max(1, min(MAX_AUTO_IMAGES, pool_bytes // IMAGE_SHARE // max(1, slot_bytes))))


def _host_has_room(config: EngineConfig) -> bool:
    """Whether the host has twice --host-kv-mib available (MemAvailable)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return False
    return avail >= 2 * config.host_kv_mib * 2**20


def host_images(config: EngineConfig) -> int:
    """--host-state-slots resolved: auto is AUTO_HOST_IMAGES when the host has twice --host-kv-mib
    available (MemAvailable), else 0."""
    if config.host_state_slots != "auto":
        return int(config.host_state_slots)
    return AUTO_HOST_IMAGES if _host_has_room(config) else 0


def host_arena(config: EngineConfig, pool: KVPool) -> PinnedArena | None:
    """The pinned host memory host images are carved from (--host-kv-mib, locked now): for a CUDA pool
    when the host has room (twice that available), else None (each copy then pins its own memory)."""
    if pool.device.type != "cuda" or config.host_kv_mib == 0:
        return None
    if not _host_has_room(config):
        log.warning(
            "host memory for --host-kv-mib %d not locked at start (less than twice that is available): "
            "each spilled image or preempted sequence pins its own, holding up the engine",
            config.host_kv_mib,
        )
        return None
    t = time.perf_counter()
    try:
        arena = PinnedArena(config.host_kv_mib * 2**20)
    except MemoryError as e:
        log.warning("host memory for --host-kv-mib not locked at start: %s", e)
        return None
    took = time.perf_counter() - t
    log.info("locked %d MiB of host memory for host images in %.2f s", config.host_kv_mib, took)
    return arena


def build_prefix(config: EngineConfig, pool: KVPool, images: int) -> PrefixCache | None:
    """The prefix cache of `images` images (with its host store when --host-state-slots resolves to more
    than 0), or None when it is off."""
    if images <= 0:
        return None
    slots = host_images(config)
    host = HostImageStore(slots, config.host_kv_mib * 2**20) if slots > 0 else None
    return PrefixCache(pool, config.prefill_chunk, images, host)


def make_proposer(config: EngineConfig) -> NgramProposer | MtpProposer | None:
    """The draft proposer of --speculative-method (None when off)."""
    if config.speculative_method == "ngram":
        return NgramProposer(config.speculative_tokens)
    if config.speculative_method == "mtp":
        return MtpProposer(config.speculative_tokens)
    return None
