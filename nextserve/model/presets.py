"""make-model's presets (tiny, small, flash-next) as text-config fields, and the config.json a checkpoint of
one gets (text or multimodal layout). Shared by make-model, the trainer and the benchmarks' random models."""

from __future__ import annotations

import copy
from typing import Any

import torch

from nextserve.config import DTYPES, GDN, QSA

BASE_FIELDS: dict[str, Any] = {
    "hidden_act": "silu",
    "output_gate_type": "sigmoid",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "norm_topk_prob": True,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "seed": 1234,
    "indexer_kv_heads": 1,
    "mtp_num_hidden_layers": 1,
    "mamba_ssm_dtype": "float32",
    "index_share_for_mtp_iteration": False,
}

# The test presets' rotary (FLASH_NEXT.md section 5): rot = 16 <= the indexer's head dim. text_config
# deep-copies a preset, so the presets may share it.
_TEST_ROPE: dict[str, Any] = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "mrope_section": [3, 3, 2],
    "mrope_interleaved": True,
}

# Text-config fields of each preset (eos_token_id comes from the tokenizer).
PRESETS: dict[str, dict[str, Any]] = {
    # FLASH_NEXT.md section 5, with a vocab big enough for a real BPE and room for long-context tests.
    "tiny": BASE_FIELDS
    | {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": [GDN, GDN, GDN, QSA],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_parameters": _TEST_ROPE,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 6,
        "max_position_embeddings": 4096,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "hc_count": 4,
        "hc_lowrank": 8,
        "ple_layer_ids": [1, 3],
        "ple_embed_dim": 32,
        "heads_per_ngram": 2,
        "ngram_vocab_size_base": 101,
        "make_ngram_vocab_size_divisible_by": 4,
        "split_ngram_parts": 1,
        "indexer_n_heads": 2,
        "indexer_head_dim": 32,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
    "small": BASE_FIELDS
    | {
        "vocab_size": 2048,
        "hidden_size": 128,
        "num_hidden_layers": 8,
        "layer_types": [QSA if i in (3, 7) else GDN for i in range(8)],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_parameters": _TEST_ROPE,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 6,
        "max_position_embeddings": 8192,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "hc_count": 4,
        "hc_lowrank": 16,
        "ple_layer_ids": [2, 6],
        "ple_embed_dim": 64,
        "heads_per_ngram": 2,
        "ngram_vocab_size_base": 1009,
        "make_ngram_vocab_size_divisible_by": 4,
        "split_ngram_parts": 2,
        "indexer_n_heads": 2,
        "indexer_head_dim": 32,
        "indexer_budget": 32,
        "indexer_compress_ratio": 4,
    },
}


def flash_next_layer_types(num_layers: int) -> list[str]:
    """Flash-Next's layer pattern for any depth: QSA at i % 4 == 3, GDN elsewhere (FLASH_NEXT.md)."""
    return [QSA if i % 4 == 3 else GDN for i in range(num_layers)]


# Flash-Next's real widths (FLASH_NEXT.md, "Real config") at the reference checkpoint's depth: 8 layers
# (QSA at 3 and 7), PLE on layer 2 (one-indexed) with a 200,000-row-per-head n-gram base (about 1 GB of
# table in bf16, where the real 2e7 base needs 102 GB). `preset_overrides` changes the depth and the base.
PRESETS["flash-next"] = BASE_FIELDS | {
    "vocab_size": 248320,
    "hidden_size": 2560,
    "num_hidden_layers": 8,
    "layer_types": flash_next_layer_types(8),
    "num_attention_heads": 24,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "max_position_embeddings": 262144,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 640,
    "shared_expert_intermediate_size": 640,
    "hc_count": 4,
    "hc_lowrank": 320,
    "ple_layer_ids": [2],
    "ple_embed_dim": 2560,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 200000,
    "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 128,
    "indexer_n_heads": 4,
    "indexer_head_dim": 128,
    "indexer_budget": 2048,
    "indexer_compress_ratio": 4,
}


def preset_overrides(
    preset: str, layers: int | None = None, ngram_vocab_base: int | None = None
) -> dict[str, Any]:
    """Overrides for `make-model --layers N --ngram-vocab-base B`: N layers in Flash-Next's pattern (QSA at
    i % 4 == 3), keeping the preset's PLE layer ids that still exist; B rows per PLE head (before primes)."""
    out: dict[str, Any] = {}
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be at least 1, got {layers}")
        out["num_hidden_layers"] = layers
        out["layer_types"] = flash_next_layer_types(layers)
        out["ple_layer_ids"] = [i for i in PRESETS[preset]["ple_layer_ids"] if i <= layers]
    if ngram_vocab_base is not None:
        if ngram_vocab_base < 2:
            raise ValueError(f"--ngram-vocab-base must be at least 2, got {ngram_vocab_base}")
        out["ngram_vocab_size_base"] = ngram_vocab_base
    return out


# The multimodal layout carries a one-block vision tower so transformers' ConditionalGeneration loads with
# no missing keys; nextserve ignores it.
VISION_CONFIG: dict[str, Any] = {
    "model_type": "qwen4_exp_vision",
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 16,
}


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Overrides win; a dict-valued override (rope_parameters) updates the preset's dict key by key."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def text_config(preset: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The preset's text-config fields with overrides merged in (no eos_token_id unless overridden)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    return _merge(PRESETS[preset], overrides or {})


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, dt in DTYPES.items() if dt == dtype)


def full_config(text: dict[str, Any], layout: str, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of a checkpoint with these text fields: transformers' CausalLM layout ("text"), or the
    released multimodal one (`text_config` inside, with a one-block vision tower)."""
    text = text | {"model_type": "qwen4_exp_text", "dtype": _dtype_name(dtype)}
    if layout == "text":
        return {"architectures": ["Qwen4ExpForCausalLM"]} | text
    return {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "dtype": text["dtype"],
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": VISION_CONFIG | {"out_hidden_size": text["hidden_size"]},
    }
