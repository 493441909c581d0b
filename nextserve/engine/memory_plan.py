"""The memory plan of an engine process: its weights by kind and place (FP8 where the checkpoint or
--quantization has them, the n-gram table on the device or in pinned host memory), its state and keep
slots, its KV pool and the headroom kept free; checked before any weight is read, and logged at start.

A model that does not fit is a ConfigError before anything big is allocated, naming the flags that would
make it fit (`--quantization fp8`, `--ple-table host`, `--max-concurrency`, `--kv-capacity`,
`--pipeline-stages`). `--ple-table auto` puts the table in host memory when the device has no room for it.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..cache.kv_pool import kv_bytes_per_token
from ..cache.states import KindRange, StateSlots
from ..config import ConfigError, ModelConfig
from ..engine_config import EngineConfig
from ..model.loader import CheckpointReader, model_fp8_capable
from ..model.params import QUANT_SUFFIXES
from ..model.shapes import expected_shapes
from ..ops.fp8 import scale_shape
from ..ops.kv8 import CODES
from ..runtime.device_memory import free_bytes

GiB = 2**30
KINDS = ("experts", "dense", "embeddings", "PLE", "MTP")
SEQUENCE_TOKENS = 65536  # the log says how many sequences of this many tokens the KV pool holds


def weight_kind(name: str) -> str:
    if name.startswith("mtp."):
        return "MTP"
    if ".mlp.experts." in name:
        return "experts"
    if "ngram_embedding" in name:
        return "PLE"
    if name.startswith(("embed_tokens.", "lm_head.")):
        return "embeddings"
    return "dense"


@dataclass
class MemoryPlan:
    device: torch.device
    fp8: frozenset[str] = frozenset()  # runtime names held in FP8
    int4: dict = field(default_factory=dict)  # runtime names held in int4: (group, scale dtype, symmetric)
    host: frozenset[str] = frozenset()  # runtime names in pinned host memory (the n-gram tables)
    weights: dict[tuple[str, str], int] = field(default_factory=dict)  # (kind, device|host) -> bytes
    slot_bytes: int = 0
    slots: int = 0  # state slots (sequences, plus the scratch slot)
    keep_slots: int = 0
    kv_per_token: int = 0
    kv_dtype: str = "auto"  # --kv-dtype: int8 planes hold a byte a value and their scales
    kv_tokens: int = 0
    prefix_images: int = 0  # state copies kept for prefix reuse (taken out of the KV pool's memory)
    headroom: int = 0
    host_arena: int = 0  # pinned host memory for host images and preempted sequences (cache/pinned_arena.py)
    expert_cache: tuple[int, int, int] = (0, 0, 0)  # (slots a layer, MoE layers, bytes): expert_cache.py
    free_at_start: int | None = None  # device memory free before loading (CUDA)

    def device_bytes(self) -> int:
        return sum(b for (_, place), b in self.weights.items() if place == "device")

    def table(self) -> str:
        """The plan as the start-up log prints it."""

        def gib(b: int) -> str:
            return f"{b / GiB:.2f} GiB" if b >= GiB else f"{b / 2**20:.1f} MiB"

        free = f", {gib(self.free_at_start)} free at start" if self.free_at_start else ""
        lines = [f"memory plan ({self.device}{free})"]
        for place in ("device", "host"):
            parts = [f"{k} {gib(self.weights[(k, place)])}" for k in KINDS if self.weights.get((k, place))]
            if parts:
                held = " (pinned)" if place == "host" else ""
                lines.append(f"  weights on the {place}{held}: " + ", ".join(parts))
        if self.fp8:
            lines.append(f"  FP8 (block-wise E4M3) tensors: {len(self.fp8)}")
        if self.int4:
            groups = sorted({g for g, _, _ in self.int4.values()})
            lines.append(f"  int4 (W4A16, groups of {', '.join(map(str, groups))}) tensors: {len(self.int4)}")
        state = self.slot_bytes * (self.slots + self.keep_slots)
        lines.append(
            f"  state slots: {self.slots} x {gib(self.slot_bytes)}"
            + (f" + {self.keep_slots} keep slots" if self.keep_slots else "")
            + f" = {gib(state)} ({self.slots - 1} sequences at once and a scratch slot)"
        )
        slots, layers, cache = self.expert_cache
        if slots:
            held = f"{slots} experts x {layers} layers = {gib(cache)}"
            lines.append(f"  expert cache: {held} (of the experts held in host memory)")
        if self.kv_tokens:
            kv = self.kv_tokens * self.kv_per_token
            fit = self.kv_tokens // SEQUENCE_TOKENS
            form = f" in {self.kv_dtype} with scales" if self.kv_dtype in CODES else ""
            lines.append(
                f"  KV pool{form}: {self.kv_tokens:,} tokens x {self.kv_per_token:,} B = {gib(kv)} "
                f"({fit} sequences of {SEQUENCE_TOKENS // 1024}K tokens)"
            )
        if self.prefix_images:
            lines.append(
                f"  prefix images: {self.prefix_images} x {gib(self.slot_bytes)} = "
                f"{gib(self.prefix_images * self.slot_bytes)} of state copies (their pages are the pool's)"
            )
        if self.host_arena:
            lines.append(
                f"  host arena (host images, preempted sequences): {gib(self.host_arena)} pinned on the host"
            )
        if self.device.type == "cuda":
            lines.append(f"  headroom (CUDA graphs, activations): {gib(self.headroom)}")
        return "\n".join(lines)


def tensor_bytes(
    shapes: dict[str, tuple[int, ...]], fp8: set[str], dtype, int4: dict | None = None
) -> dict[str, int]:
    """Each runtime tensor's bytes as it will be held: FP8 with its block scales, int4 words with their
    group scales (and zero points), the rest in dtype."""
    elem = torch.empty((), dtype=dtype).element_size()
    int4 = int4 or {}
    out = {}
    for name, shape in shapes.items():
        n = math.prod(shape)
        b = n + 4 * math.prod(scale_shape(shape)) if name in fp8 else n * elem
        if name in int4:  # words, and a scale (and zero point) a group
            group, scale_dtype, symmetric = int4[name]
            b = n // 2 + (n // group) * (scale_dtype.itemsize + (0 if symmetric else 1))
        out[name] = b
    return out


def held_formats(
    config: EngineConfig, cfg: ModelConfig, device: torch.device, with_mtp: bool
) -> tuple[dict[str, tuple[int, ...]], set[str], dict]:
    """(the runtime shapes, the names held in FP8, the names held in int4 with their grouping) of
    config.model, as the loader will decide them (read from the checkpoint's headers and config only)."""
    shapes = expected_shapes(cfg, with_mtp=with_mtp)
    capable = model_fp8_capable(cfg, with_mtp)
    with ExitStack() as stack:
        reader = CheckpointReader(Path(config.model), cfg, shapes, stack)
        fp8 = reader.fp8_names(capable.__contains__, config.quantization, device)
        int4 = reader.int4_names(capable.__contains__, config.quantization)
    return shapes, fp8, int4


def held_tensor_bytes(
    config: EngineConfig, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, with_mtp: bool
) -> dict[str, int]:
    """`tensor_bytes` of config.model as the loader will hold it (its FP8 and int4 decisions)."""
    shapes, fp8, int4 = held_formats(config, cfg, device, with_mtp)
    return tensor_bytes(shapes, fp8, dtype, int4)


def _predicted_bytes(
    shapes: dict[str, tuple[int, ...]], fp8: set[str], host: set[str], dtype, int4: dict | None = None
) -> dict:
    out: dict[tuple[str, str], int] = {}
    for name, b in tensor_bytes(shapes, fp8, dtype, int4).items():
        key = (weight_kind(name), "host" if name in host else "device")
        out[key] = out.get(key, 0) + b
    return out


def module_bytes(module: nn.Module, prefix: str = "") -> dict[tuple[str, str], int]:
    """What a loaded module's parameters take, by kind and place (an FP8 tensor's scales with it)."""
    out: dict[tuple[str, str], int] = {}
    for name, p in module.named_parameters():
        suffix = next((s for s in QUANT_SUFFIXES if name.endswith(s)), "")
        rt = prefix + (name[: -len(suffix)] if suffix else name)
        key = (weight_kind(rt), "host" if not p.is_cuda and p.is_pinned() else "device")
        out[key] = out.get(key, 0) + p.numel() * p.element_size()
    return out


def headroom_bytes(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Device bytes kept free beside the weights, slots and KV pool: --memory-headroom-mib, plus, with
    --prefill-batch-chunks N > 1, what the other N - 1 chunks of a forward hold at once (each chunk's
    streams and block input, the routed experts' rows of all of them: an estimate per token)."""
    extra_chunks = config.prefill_forward_chunks() - 1
    H, I, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    per_token = dtype.itemsize * (3 * cfg.hc_hidden + 4 * H + k * (H + I))
    return config.memory_headroom_mib * 2**20 + extra_chunks * config.prefill_chunk * per_token


def state_plan(
    config: EngineConfig, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, steps: int
) -> MemoryPlan:
    """A one-process engine's plan without its weights: state and keep slots, KV bytes per token, headroom."""
    n_attn = len(cfg.qsa_layers) + 1  # the MTP layer's planes come last
    kinds = KindRange(range(len(cfg.gdn_layers)), range(len(cfg.ple_layers)), range(n_attn))
    return MemoryPlan(
        device, slot_bytes=StateSlots.slot_bytes(cfg, kinds, dtype),
        slots=1 + config.max_concurrency, keep_slots=config.max_concurrency * steps,
        kv_per_token=kv_bytes_per_token(cfg, n_attn, dtype, config.kv_dtype), kv_dtype=config.kv_dtype,
        headroom=headroom_bytes(config, cfg, dtype),
    )  # fmt: skip


def plan_memory(
    config: EngineConfig,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    steps: int,
    with_mtp: bool,
) -> MemoryPlan:
    """The plan of a one-process engine over config.model, before its weights are read: FP8 and host
    placement decided (as the loader will), the fit checked (ConfigError) on a GPU."""
    shapes, fp8, int4 = held_formats(config, cfg, device, with_mtp)
    plan = state_plan(config, cfg, device, dtype, steps)
    plan.fp8, plan.int4 = frozenset(fp8), dict(int4)
    ple = {n for n in shapes if weight_kind(n) == "PLE"}
    experts = {n for n in shapes if weight_kind(n) == "experts"}
    host = ple if config.ple_table == "host" and device.type == "cuda" else set()
    if config.experts == "host" and device.type == "cuda":
        host = host | experts
    if device.type == "cuda":
        plan.free_at_start = free_bytes(device, config.gpu_memory_gib)
        # NOTE: what does not fit moves to the host in this order: the n-gram table (a few rows a token
        # cross the bus), then the routed experts (the experts a step routes to cross it)
        if config.ple_table == "auto":
            on_device = _predicted_bytes(shapes, fp8, host, dtype, int4)
            if _need(plan, on_device, config) > plan.free_at_start:
                host = host | ple
        if config.experts == "auto":
            on_device = _predicted_bytes(shapes, fp8, host, dtype, int4)
            if _need(plan, on_device, config) > plan.free_at_start:
                host = host | experts
    plan.host = frozenset(host)
    plan.weights = _predicted_bytes(shapes, fp8, host, dtype, int4)
    if device.type == "cuda":
        _check_fits(plan, config, shapes, dtype, ple)
    return plan


def _need(plan: MemoryPlan, weights: dict, config: EngineConfig) -> int:
    """Device bytes of weights, slots, headroom and the smallest KV pool (one page, or --kv-capacity)."""
    kv = config.kv_capacity if config.kv_capacity != "auto" else config.page_size
    dev = sum(b for (_, place), b in weights.items() if place == "device")
    return dev + plan.slot_bytes * (plan.slots + plan.keep_slots) + plan.headroom + kv * plan.kv_per_token


def _check_fits(plan: MemoryPlan, config: EngineConfig, shapes, dtype, ple: set[str]) -> None:
    need = _need(plan, plan.weights, config)
    if need <= plan.free_at_start:
        return
    hints = []
    plain = [n for n in shapes if n not in plan.fp8 and n not in plan.int4]
    plain = [n for n in plain if weight_kind(n) in ("experts", "dense", "MTP")]
    elem = torch.empty((), dtype=dtype).element_size()
    if plain and config.quantization not in ("fp8", "int4") and dtype != torch.float32:
        saved = sum(math.prod(shapes[n]) for n in plain) * (elem - 1)
        hints.append(f"--quantization fp8 (about {saved / GiB:.0f} GiB less)")
    if plain and config.quantization != "int4" and dtype != torch.float32:
        saved = sum(math.prod(shapes[n]) for n in plain) * (elem - 0.5 - elem / 128)
        hints.append(f"--quantization int4 (about {saved / GiB:.0f} GiB less)")
    if ple and not ple <= plan.host:
        hints.append(
            f"--ple-table host ({plan.weights.get(('PLE', 'device'), 0) / GiB:.1f} GiB to host memory)"
        )
    if plan.weights.get(("experts", "device")):
        hints.append(
            f"--experts host ({plan.weights[('experts', 'device')] / GiB:.1f} GiB of routed experts to host "
            "memory, read by the GPU over the bus)"
        )
    state = plan.slot_bytes * (plan.slots + plan.keep_slots)
    hints.append(f"a lower --max-concurrency (the state slots take {state / GiB:.2f} GiB)")
    if config.kv_capacity != "auto":
        hints.append("a lower --kv-capacity")
    hints.append("--pipeline-stages N (the layers split over N GPUs)")
    raise ConfigError(
        f"the model does not fit {plan.device}: it needs {need / GiB:.1f} GiB (weights "
        f"{plan.device_bytes() / GiB:.1f}, state {state / GiB:.2f}, headroom {plan.headroom / GiB:.1f}) and "
        f"{plan.free_at_start / GiB:.1f} GiB are free. Try " + "; ".join(hints) + f".\n{plan.table()}"
    )
