"""Typed configs: ModelConfig (read from a model directory's config.json) and EngineConfig (every flag)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch

GDN = "linear_attention"
QSA = "indexed_attention"
# NOTE: shipped configs say full_attention, transformers 5.23 indexed_attention, 5.17 and vLLM
# qwen_sparse_attention; all three mean a QSA layer.
_QSA_ALIASES = {"full_attention", "indexed_attention", "qwen_sparse_attention"}
_KNOWN_MODEL_TYPES = {"qwen4_exp", "qwen4_exp_text"}

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}


class ConfigError(ValueError):
    """A model directory or flag that cannot be used, with a message that names the problem."""


# --prefill-batch-chunks auto in one process: chunks up to this many tokens a forward (vLLM's prefill step;
# 4 chunks at the default 4,096: BENCHMARKS.md, session 18)
AUTO_PREFILL_BATCH_TOKENS = 16384


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    output_gate: str
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    hc_count: int
    hc_lowrank: int
    ple_layer_ids: tuple[int, ...]
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    split_ngram_parts: int
    seed: int
    eos_token_id: int
    indexer_n_heads: int
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int
    mtp_num_hidden_layers: int = 1
    index_share_for_mtp_iteration: bool = False
    layout: str = "text"  # "text" (model.*) or "multimodal" (model.language_model.*)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # config.json's quantization_config as it is (model/quant.py reads it)
    quantization_config: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.hidden_size <= 0 or self.num_hidden_layers <= 0 or self.vocab_size <= 0:
            raise ConfigError("hidden_size, num_hidden_layers and vocab_size must be positive")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        bad = sorted(set(self.layer_types) - {GDN, QSA})
        if bad:
            raise ConfigError(f"unsupported layer types {bad}")
        if self.output_gate not in ("sigmoid", "silu"):
            raise ConfigError(f"unsupported output_gate_type {self.output_gate!r}")
        if self.hc_count <= 1:
            raise ConfigError(f"hc_count must be > 1, got {self.hc_count}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError("num_experts_per_tok must be in [1, num_experts]")
        if self.indexer_budget % self.indexer_compress_ratio:
            raise ConfigError("indexer_budget must be divisible by indexer_compress_ratio")
        if self.rotary_dim > self.indexer_head_dim or self.rotary_dim % 2:
            raise ConfigError(f"rotary dim {self.rotary_dim} must be even and fit indexer_head_dim")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        for lid in self.ple_layer_ids:
            if not 1 <= lid <= self.num_hidden_layers:
                raise ConfigError(f"ple_layer_ids are one-indexed layer ids; {lid} is out of range")
            if self.layer_types[lid - 1] != GDN:
                raise ConfigError(f"PLE is only supported on linear_attention layers (layer id {lid})")
        if self.ple_layer_ids and self.ple_embed_dim % self.ple_num_heads:
            raise ConfigError("ple_embed_dim must be divisible by (ngram_size-1)*heads_per_ngram")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qsa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == QSA)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == GDN)

    @property
    def ple_layers(self) -> tuple[int, ...]:
        """Zero-indexed decoder layers that carry PLE, in ple_index order."""
        return tuple(lid - 1 for lid in self.ple_layer_ids)

    @property
    def ple_num_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )

    @property
    def block_topk(self) -> int:
        return self.indexer_budget // self.indexer_compress_ratio

    @property
    def hc_hidden(self) -> int:
        return self.hc_count * self.hidden_size

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in _KNOWN_MODEL_TYPES:
            raise ConfigError(
                f"unknown model_type {model_type!r}: nextserve serves qwen4_exp / qwen4_exp_text models"
            )
        layout = "text"
        text = raw
        if model_type == "qwen4_exp":
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("config.json of model_type qwen4_exp has no text_config")
            layout = "multimodal"
        return cls._from_text(text, layout, raw)

    @classmethod
    def _from_text(cls, t: dict[str, Any], layout: str, raw: dict[str, Any]) -> ModelConfig:
        def need(name: str) -> Any:
            if t.get(name) is None:
                raise ConfigError(f"config.json is missing required field {name!r}")
            return t[name]

        n_layers = int(need("num_hidden_layers"))
        layer_types = t.get("layer_types")
        if layer_types is None:
            interval = int(t.get("full_attention_interval", 4))
            layer_types = [GDN if (i + 1) % interval else QSA for i in range(n_layers)]
        layer_types = tuple(QSA if lt in _QSA_ALIASES else lt for lt in layer_types)
        rope = t.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", t.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 1.0))
        eos = t.get("eos_token_id", raw.get("eos_token_id"))
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is None:
            raise ConfigError("config.json is missing eos_token_id")
        hidden = int(need("hidden_size"))
        known = {f.name for f in fields(cls)}
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=int(t.get("head_dim") or hidden // int(need("num_attention_heads"))),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            linear_conv_kernel_dim=int(t.get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(t.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(t.get("linear_value_head_dim", 128)),
            linear_num_key_heads=int(t.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(t.get("linear_num_value_heads", 32)),
            output_gate=str(t.get("output_gate_type") or t.get("hidden_act", "silu")),
            hidden_act=str(t.get("hidden_act", "silu")),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(t.get("max_position_embeddings", 32768)),
            num_experts=int(need("num_experts")),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            shared_expert_intermediate_size=int(need("shared_expert_intermediate_size")),
            norm_topk_prob=bool(t.get("norm_topk_prob", True)),
            hc_count=int(t.get("hc_count", 4)),
            hc_lowrank=int(t.get("hc_lowrank", 320)),
            ple_layer_ids=tuple(sorted(set(t.get("ple_layer_ids") or []))),
            ple_embed_dim=int(t.get("ple_embed_dim") or hidden),
            ple_conv_kernel_size=int(t.get("ple_conv_kernel_size", 4)),
            ngram_size=int(t.get("ngram_size", 3)),
            heads_per_ngram=int(t.get("heads_per_ngram", 8)),
            ngram_vocab_size_base=int(t.get("ngram_vocab_size_base", 20_000_000)),
            make_ngram_vocab_size_divisible_by=int(t.get("make_ngram_vocab_size_divisible_by", 128)),
            split_ngram_parts=int(t.get("split_ngram_parts", 512)),
            seed=int(t.get("seed", 1234)),
            eos_token_id=int(eos),
            indexer_n_heads=int(need("indexer_n_heads")),
            indexer_head_dim=int(need("indexer_head_dim")),
            indexer_budget=int(need("indexer_budget")),
            indexer_compress_ratio=int(need("indexer_compress_ratio")),
            mtp_num_hidden_layers=int(t.get("mtp_num_hidden_layers", raw.get("mtp_num_hidden_layers", 1))),
            index_share_for_mtp_iteration=bool(t.get("index_share_for_mtp_iteration", False)),
            layout=layout,
            extra={k: v for k, v in t.items() if k not in known},
            quantization_config=raw.get("quantization_config", t.get("quantization_config")),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        if not path.is_dir():
            raise ConfigError(f"model directory {str(path)!r} does not exist")
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{str(path)!r} has no config.json")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{cfg_path} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{cfg_path} must hold a JSON object")
        return cls.from_dict(raw)


def kv_round_up(n: int, m: int) -> int:
    return int(math.ceil(n / m) * m)


# The small Flash-Next that ships inside the package (tools/train_default_model.py trained it).
DEFAULT_MODEL = str(files("nextserve") / "assets" / "default_model")
DEFAULT_MODEL_NAME = "nextserve-default"


@dataclass(frozen=True)
class EngineConfig:
    """Every engine mode; each field is a `nextserve serve` flag of the same name (C3)."""

    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    device: str = "auto"  # auto: cuda when available
    prefill_chunk: int = 4096  # BENCHMARKS.md session 12: 62.7K cold TTFT 1.13 s against 1.94 at 1024
    max_concurrency: int = 16
    kv_capacity: int | str = "auto"  # tokens in the pool, or "auto"
    max_context: int | None = None  # per sequence; default: the model's max_position_embeddings
    page_size: int = 64
    max_pending: int = 256
    memory_headroom_mib: int = 2048
    cpu_kv_budget_mib: int = 1024
    seed: int = 0
    prefix_cache: bool = True  # prefix reuse (--no-prefix-cache: off)
    prefix_cache_images: int | str = "auto"  # grid images kept for prefix reuse; auto: sized with the pool
    prefix_anchor_chunks: int = 0  # also keep an image every N chunks of long prompts (0: none)
    cuda_graph: bool = True  # replay decode steps and verify windows as CUDA graphs (GPU only)
    pdl: bool = True  # programmatic dependent launch of the Triton kernels (sm_90+ GPUs only)
    async_scheduling: bool = True  # launch a greedy decode step before reading the previous one's tokens
    speculative_method: str = "off"  # "ngram" (prompt lookup) or "mtp" (the MTP block): drafts to verify
    speculative_tokens: int = 4  # draft tokens per verify window at most
    pipeline_stages: int = 1  # processes the layers are split across, one device each
    pipeline_devices: str | None = None  # CUDA index per stage, "0,1" (default: consecutive from --device's)
    decode_groups: int = 1  # pipeline decode rows as this many groups in flight across the stages
    pipeline_prefill_chunks: int | str = "auto"  # a prompt's chunks a step sends in (auto: one per stage)
    # one process: prompt chunks one forward runs, each as it runs alone, their routed experts in one call
    # (auto: 16,384 tokens a forward in one process, 4 chunks at the default chunk; BENCHMARKS.md session 18:
    # a cold 62.7K prompt 1.14x, four 16K prompts 1.20x, 1K prompts 1.40x; with pipeline stages one)
    prefill_batch_chunks: int | str = "auto"
    stage_transport: str = "auto"  # activations between stages: nccl, host (pinned memory + Gloo), auto
    head_embedding: str = "device"  # the last stage's MTP token embeddings: a device copy, or host (pinned)
    pipeline_windows: bool = False  # front stages run the MTP-guessed next window while the last verifies
    host_state_slots: int | str = "auto"  # prefix images kept in host memory (0: off; auto: on if room)
    host_kv_mib: int = 4096  # host memory for the host image store and preempted sequences
    skip_tokenizer: bool = False  # token ids in and out, no text (a model directory without a tokenizer)
    quantization: str = "auto"  # auto: as the checkpoint is; fp8: quantize its projections on load; none
    ple_table: str = "auto"  # where the n-gram table lives: device, host (pinned), auto (host if no room)
    warm_up: bool = True  # compile every kernel specialisation at start, before serving (GPU only)
    compile_cache_dir: str | None = None  # Triton's compile cache (a restart then compiles nothing)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        ints = ("prefill_chunk", "max_concurrency", "page_size", "max_pending", "pipeline_stages")
        ints += ("decode_groups",)
        for name in ints:
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.kv_capacity != "auto" and (not isinstance(self.kv_capacity, int) or self.kv_capacity <= 0):
            raise ConfigError(f"kv_capacity must be a positive integer or 'auto', got {self.kv_capacity!r}")
        if self.max_context is not None and (not isinstance(self.max_context, int) or self.max_context <= 0):
            raise ConfigError(f"max_context must be a positive integer, got {self.max_context!r}")
        counts = ("prefix_cache_images", "prefix_anchor_chunks", "seed", "host_state_slots", "host_kv_mib")
        for name in counts:
            value = getattr(self, name)
            if value == "auto" and name in ("prefix_cache_images", "host_state_slots"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                auto = " or 'auto'" if name in ("prefix_cache_images", "host_state_slots") else ""
                raise ConfigError(f"{name} must be a non-negative integer{auto}, got {value!r}")
        if not isinstance(self.prefix_cache, bool):
            raise ConfigError(f"prefix_cache must be true or false, got {self.prefix_cache!r}")
        images = self.prefix_cache_images if self.prefix_cache else 0
        if self.host_state_slots not in (0, "auto") and images == 0:
            raise ConfigError(
                "host_state_slots needs prefix reuse on (prefix_cache_images > 0 or auto): it keeps "
                "device spills"
            )
        if self.ple_table not in ("auto", "device", "host"):
            raise ConfigError(f"ple_table must be auto, device or host, got {self.ple_table!r}")
        if self.quantization not in ("auto", "fp8", "none"):
            raise ConfigError(f"quantization must be auto, fp8 or none, got {self.quantization!r}")
        if self.speculative_method not in ("off", "ngram", "mtp"):
            raise ConfigError(
                f"speculative_method must be off, ngram or mtp, got {self.speculative_method!r}"
            )
        if not isinstance(self.speculative_tokens, int) or not 1 <= self.speculative_tokens <= 32:
            raise ConfigError(f"speculative_tokens must be in 1..32, got {self.speculative_tokens!r}")
        if self.compile_cache_dir is not None and (
            not isinstance(self.compile_cache_dir, str) or not self.compile_cache_dir
        ):
            raise ConfigError(f"compile_cache_dir must be a directory path, got {self.compile_cache_dir!r}")
        bools = ("cuda_graph", "pdl", "async_scheduling", "skip_tokenizer", "warm_up", "pipeline_windows")
        for name in bools:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.memory_headroom_mib < 0 or self.cpu_kv_budget_mib <= 0:
            raise ConfigError("memory_headroom_mib must be >= 0 and cpu_kv_budget_mib > 0")
        self._check_stage_flags()

    def _check_stage_flags(self) -> None:
        """stage_transport and pipeline_devices (normalised to "i,j,..." when given as a list of ints)."""
        if self.decode_groups > 1 and self.pipeline_stages < 2:
            raise ConfigError("decode_groups > 1 keeps pipeline stages busy: it needs pipeline_stages > 1")
        if self.decode_groups > 64:
            raise ConfigError(f"decode_groups must be at most 64, got {self.decode_groups!r}")
        chunks = self.pipeline_prefill_chunks
        if chunks != "auto":
            if not isinstance(chunks, int) or isinstance(chunks, bool) or not 1 <= chunks <= 64:
                raise ConfigError(f"pipeline_prefill_chunks must be 'auto' or in 1..64, got {chunks!r}")
            if chunks > 1 and self.pipeline_stages < 2:
                raise ConfigError(
                    "pipeline_prefill_chunks > 1 keeps pipeline stages busy: it needs pipeline_stages > 1"
                )
        batch = self.prefill_batch_chunks
        if batch != "auto" and (
            not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= 64
        ):
            raise ConfigError(f"prefill_batch_chunks must be 'auto' or in 1..64, got {batch!r}")
        if batch != "auto" and batch > 1 and self.pipeline_stages > 1:
            raise ConfigError(
                "prefill_batch_chunks > 1 runs several prompt chunks in one forward of one process; with "
                "pipeline stages a step's chunks overlap across the stages (--pipeline-prefill-chunks)"
            )
        if self.stage_transport not in ("auto", "nccl", "host"):
            raise ConfigError(f"stage_transport must be auto, nccl or host, got {self.stage_transport!r}")
        if self.head_embedding not in ("device", "host"):
            raise ConfigError(f"head_embedding must be device or host, got {self.head_embedding!r}")
        if self.head_embedding == "host" and (self.pipeline_stages < 2 or self.speculative_method != "mtp"):
            raise ConfigError(
                "head_embedding host is where the last pipeline stage's MTP block reads its token "
                "embeddings: it needs pipeline_stages > 1 and speculative_method mtp (one process reads "
                "the model's own table)"
            )
        if self.pipeline_windows and (self.pipeline_stages < 2 or self.speculative_method != "mtp"):
            raise ConfigError(
                "pipeline_windows runs the MTP block's guess of the next verify window on the front stages "
                "while the last stage verifies: it needs pipeline_stages > 1 and speculative_method mtp"
            )
        if self.device == "cpu" and self.stage_transport == "nccl":
            raise ConfigError(
                "stage_transport nccl needs CUDA devices; CPU stages pass activations over Gloo (host)"
            )
        devices = self.pipeline_devices
        if devices is None:
            return
        if isinstance(devices, list | tuple) and all(type(i) is int for i in devices):
            devices = ",".join(map(str, devices))
        parts = devices.split(",") if isinstance(devices, str) else None
        if parts is None or not all(p.strip().isascii() and p.strip().isdigit() for p in parts):
            raise ConfigError(
                f"pipeline_devices must be comma-separated CUDA device indices such as 0,1, got {devices!r}"
            )
        indices = [int(p) for p in parts]
        # NOTE: NCCL runs one rank per GPU; through host memory several stages may share a GPU (one GPU
        # then runs the stage processes, as tests/gpu/test_pipeline_cuda.py does on a single H200).
        if len(set(indices)) != len(indices) and self.stage_transport != "host":
            raise ConfigError(
                f"pipeline_devices names a GPU twice, which needs --stage-transport host (NCCL runs one "
                f"stage per GPU), got {devices!r}"
            )
        if self.pipeline_stages < 2 or len(indices) != self.pipeline_stages:
            raise ConfigError(
                f"pipeline_devices names {len(indices)} devices: give one per stage, with pipeline_stages "
                f"> 1 (pipeline_stages is {self.pipeline_stages}; one device is --device cuda:N)"
            )
        if self.device == "cpu":
            raise ConfigError("pipeline_devices are CUDA devices; it does not go with device cpu")
        object.__setattr__(self, "pipeline_devices", ",".join(map(str, indices)))

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device cuda was asked for but no CUDA device is available")
        return dev

    @property
    def state_slots(self) -> int:
        """State slots to allocate: one per sequence, and with pipeline_windows the shadow slot the guessed
        windows run on (runtime/pipeline.py)."""
        return self.max_concurrency + int(self.pipeline_windows)

    def prefill_chunks_per_step(self) -> int:
        """Prompt chunks one step runs at most: one process, prefill_batch_chunks (in one forward); with
        pipeline stages, those a step sends in (auto: one per stage)."""
        if self.pipeline_stages == 1:
            batch = self.prefill_batch_chunks
            if batch == "auto":
                return max(1, min(64, AUTO_PREFILL_BATCH_TOKENS // self.prefill_chunk))
            return batch
        chunks = self.pipeline_prefill_chunks
        return self.pipeline_stages if chunks == "auto" else chunks

    def prefill_forward_chunks(self) -> int:
        """Prompt chunks one forward may run together (FlashNext.forward_chunks): a step's chunks in one
        process; one with pipeline stages, whose stages run a step's chunks one after another."""
        return self.prefill_chunks_per_step() if self.pipeline_stages == 1 else 1

    def stage_devices(self) -> list[torch.device]:
        """Each pipeline stage's device: pipeline_devices, else consecutive CUDA indices from --device's
        (cuda: 0, 1, ...; cuda:2: 2, 3, ...); every stage on the CPU backend is the CPU."""
        dev = self.torch_device()
        if dev.type != "cuda":
            return [dev] * self.pipeline_stages
        if self.pipeline_devices is not None:
            return [torch.device("cuda", int(i)) for i in self.pipeline_devices.split(",")]
        return [torch.device("cuda", (dev.index or 0) + i) for i in range(self.pipeline_stages)]

    def stage_transport_kind(self) -> str:
        """stage_transport with auto resolved: nccl on CUDA, host on the CPU (Gloo only)."""
        if self.stage_transport != "auto":
            return self.stage_transport
        return "nccl" if self.torch_device().type == "cuda" else "host"

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return DTYPES[self.dtype]
