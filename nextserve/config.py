"""ModelConfig, read from a model directory's config.json; the layer-type names and dtypes; ConfigError.
The engine's flags are engine_config.EngineConfig."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
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
