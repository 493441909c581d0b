"""Write random Flash-Next checkpoints in Hugging Face layout, for tests and benchmarks.

A checkpoint made here loads in transformers (`Qwen4ExpForCausalLM` for the text layout,
`Qwen4ExpForConditionalGeneration` for the multimodal one) with no missing or unexpected keys, so it serves
as the shared input of nextserve and the transformers oracle. Every tensor is drawn from its own generator,
seeded by (seed, tensor name): values do not depend on layout, sharding, expert fusion or MTP.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from nextserve.config import DTYPES, GDN, QSA, ModelConfig
from nextserve.model.checkpoint import INDEX_FILE
from nextserve.model.loader import PROGRESS_MIN_BYTES
from nextserve.model.ple import head_vocab_sizes, multipliers
from nextserve.model.quant import fp8_config_json
from nextserve.model.shapes import expected_shapes
from nextserve.model.tokenizer_build import ENDOFTEXT, IM_END, build_tokenizer, default_corpus

TOKENIZER_CORPUS_CHARS = 400_000  # enough text for a few thousand merges; trains in well under a second

_BASE: dict[str, Any] = {
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

# Text-config fields of each preset (eos_token_id comes from the tokenizer).
PRESETS: dict[str, dict[str, Any]] = {
    # FLASH_NEXT.md section 5, with a vocab big enough for a real BPE and room for long-context tests.
    "tiny": _BASE
    | {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": [GDN, GDN, GDN, QSA],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
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
    "small": _BASE
    | {
        "vocab_size": 2048,
        "hidden_size": 128,
        "num_hidden_layers": 8,
        "layer_types": [QSA if i in (3, 7) else GDN for i in range(8)],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
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


# Flash-Next's real widths (FLASH_NEXT.md, "Real config") at issue 6's benchmark depth: 8 layers (QSA at 3
# and 7), PLE on layer 2 (one-indexed) with a 200,000-row-per-head n-gram base (about 1 GB of table in bf16,
# where the real 2e7 base needs 102 GB). `preset_overrides` changes the depth and the base.
PRESETS["flash-next"] = _BASE | {
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
_VISION_CONFIG: dict[str, Any] = {
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


Shape = tuple[int, ...]


# ---- config ----------------------------------------------------------------------------------------------


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


def _full_config(text: dict[str, Any], layout: str, dtype: torch.dtype) -> dict[str, Any]:
    text = text | {"model_type": "qwen4_exp_text", "dtype": _dtype_name(dtype)}
    if layout == "text":
        return {"architectures": ["Qwen4ExpForCausalLM"]} | text
    return {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "dtype": text["dtype"],
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": _VISION_CONFIG | {"out_hidden_size": text["hidden_size"]},
    }


# ---- tensor plan -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    name: str  # checkpoint name
    shape: Shape
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _seed_for(seed: int, key: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _init(key: str, shape: Shape, gen: torch.Generator) -> torch.Tensor:
    """Random fp32 values with scales that keep a forward pass tame and every code path live.

    Projections get std 1/sqrt(fan_in), so each block maps O(1) inputs to O(1) outputs at any width.
    Embeddings are O(1) too: the hyper-connections normalise each stream anyway, and unit scale keeps the
    token signal comparable to the block outputs added to the residual.
    """

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    module = key.rsplit(".", 2)[-2] if key.endswith(".weight") else ""
    if key.startswith("model.visual."):
        return normal(0.02)
    if key.endswith("linear_attn.norm.weight"):
        return normal(0.1, mean=1.0)  # plain-weight gated norm: w, not 1+w
    if key.endswith("A_log"):
        return torch.rand(shape, generator=gen).mul(16 - 0.01).add(0.01).log()  # log U(0.01, 16)
    if key.endswith("dt_bias"):
        return normal(0.1, mean=1.0)
    if "norm" in module:
        return normal(0.1)  # (1+w) norms: non-zero so the weight path is exercised
    if key.endswith("ple.conv1d.weight"):
        return normal(0.2)  # transformers zero-inits it, which would hide the PLE conv entirely
    if key.endswith("linear_attn.conv1d.weight"):
        return normal(1 / math.sqrt(shape[-1]))
    if key.endswith("embed_tokens.weight") or ".ngram_embedding." in key:
        return normal(1.0)
    if key == "lm_head.weight":
        # Logits std ~1.5 as in a trained model, so greedy argmax rarely sits on a near-tie.
        return normal(3 / math.sqrt(shape[-1]))
    return normal(1 / math.sqrt(shape[-1]))


def _random(seed: int, key: str, shape: Shape, dtype: torch.dtype) -> _Tensor:
    def make() -> torch.Tensor:
        gen = torch.Generator().manual_seed(_seed_for(seed, key))
        return _init(key, shape, gen).to(dtype)

    return _Tensor(key, shape, dtype, make)


def _const(name: str, value: torch.Tensor) -> _Tensor:
    return _Tensor(name, tuple(value.shape), value.dtype, lambda: value)


def _chunk_rows(rows: int, parts: int) -> list[int]:
    # torch.chunk's split, which transformers' save uses: ceil-sized chunks, possibly fewer than `parts`.
    size = math.ceil(rows / parts)
    return [min(size, rows - start) for start in range(0, rows, size)]


def _ple_tensors(
    cfg: ModelConfig, seed: int, key: str, shape: Shape, dtype: torch.dtype
) -> Iterator[_Tensor]:
    layer = int(key.split(".")[1])
    ple_index = cfg.ple_layers.index(layer)
    base = key[: -len(".weight")]
    for i, rows in enumerate(_chunk_rows(shape[0], cfg.split_ngram_parts)):
        # Each row shard has its own generator so a huge table never needs to exist in memory at once.
        yield _random(seed, f"{base}.shard_{i}.weight", (rows, shape[1]), dtype)
    sizes = head_vocab_sizes(cfg.ngram_vocab_size_base, ple_index, cfg.ple_num_heads)
    offsets = [sum(sizes[:h]) for h in range(len(sizes))]
    emb = key[: -len(".ngram_embedding.weight")]
    yield _const(
        f"{emb}.layer_multipliers",
        torch.tensor(multipliers(cfg.vocab_size, cfg.ngram_size, ple_index, cfg.seed)),
    )
    yield _const(f"{emb}.ngram_heads_vocab_sizes", torch.tensor(sizes, dtype=torch.long))
    yield _const(f"{emb}.ngram_heads_offsets", torch.tensor(offsets, dtype=torch.long))


def _expert_tensors(
    cfg: ModelConfig, seed: int, key: str, shape: Shape, dtype: torch.dtype, fused: bool
) -> Iterator[_Tensor]:
    base = key.rsplit(".", 1)[0]  # ...mlp.experts
    projs = ("gate_proj", "up_proj") if key.endswith("gate_up_proj") else ("down_proj",)
    per_expert = [
        _random(
            seed,
            f"{base}.{e}.{proj}.weight",
            shape[1:] if proj == "down_proj" else (shape[1] // 2, shape[2]),
            dtype,
        )
        for e in range(cfg.num_experts)
        for proj in projs
    ]
    if not fused:
        yield from per_expert
        return

    def make() -> torch.Tensor:
        # Built from the per-expert draws, so fused and per-expert checkpoints hold the same values.
        rows = [t.make() for t in per_expert]  # gate_e, up_e, gate_e+1, ... -> [E, 2I, H] gate rows first
        return torch.stack([torch.cat(rows[e : e + len(projs)]) for e in range(0, len(rows), len(projs))])

    yield _Tensor(key, shape, dtype, make)


def _checkpoint_name(key: str, layout: str) -> str:
    if key.startswith(("mtp.", "lm_head.")):
        return key
    return ("model.language_model." if layout == "multimodal" else "model.") + key


def _vision_tensors(seed: int, hidden: int, dtype: torch.dtype) -> Iterator[_Tensor]:
    vc = _VISION_CONFIG
    d, ff, merged = (
        vc["hidden_size"],
        vc["intermediate_size"],
        vc["hidden_size"] * vc["spatial_merge_size"] ** 2,
    )
    patch = (d, vc["in_channels"], vc["temporal_patch_size"], vc["patch_size"], vc["patch_size"])
    shapes: dict[str, Shape] = {
        "patch_embed.proj.weight": patch,
        "patch_embed.proj.bias": (d,),
        "pos_embed.weight": (vc["num_position_embeddings"], d),
        "merger.norm.weight": (d,),
        "merger.norm.bias": (d,),
        "merger.linear_fc1.weight": (merged, merged),
        "merger.linear_fc1.bias": (merged,),
        "merger.linear_fc2.weight": (hidden, merged),
        "merger.linear_fc2.bias": (hidden,),
    }
    for b in range(vc["depth"]):
        p = f"blocks.{b}."
        shapes |= {
            f"{p}norm1.weight": (d,),
            f"{p}norm1.bias": (d,),
            f"{p}norm2.weight": (d,),
            f"{p}norm2.bias": (d,),
            f"{p}attn.qkv.weight": (3 * d, d),
            f"{p}attn.qkv.bias": (3 * d,),
            f"{p}attn.proj.weight": (d, d),
            f"{p}attn.proj.bias": (d,),
            f"{p}mlp.linear_fc1.weight": (ff, d),
            f"{p}mlp.linear_fc1.bias": (ff,),
            f"{p}mlp.linear_fc2.weight": (d, ff),
            f"{p}mlp.linear_fc2.bias": (d,),
        }
    for name, shape in shapes.items():
        yield _random(seed, f"model.visual.{name}", shape, dtype)


def checkpoint_tensors(
    cfg: ModelConfig, seed: int, layout: str, fused_experts: bool, with_mtp: bool, dtype: torch.dtype
) -> list[_Tensor]:
    """Every tensor of the checkpoint, in file order, named as transformers saves them."""
    out: list[_Tensor] = []
    for key, shape in expected_shapes(cfg, with_mtp=with_mtp).items():
        if key.startswith("mtp.layer."):
            key = "mtp.layers.0." + key[len("mtp.layer.") :]
        if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            out += _expert_tensors(cfg, seed, key, shape, dtype, fused_experts)
        elif key.endswith("ple.ple_embedding.ngram_embedding.weight"):
            out += _ple_tensors(cfg, seed, key, shape, dtype)
        else:
            out.append(_random(seed, key, shape, dtype))
        if key == "mtp.hyper_connection_mixer.input_mix_weight_up.weight":
            # Shipped MTP mixers carry an inject weight that no loader uses; keep it so loaders must skip it.
            n, nh = cfg.hc_count, cfg.hc_hidden
            out.append(_random(seed, "mtp.hyper_connection_mixer.block_inject_weight.weight", (n, nh), dtype))
    out = [replace(t, name=_checkpoint_name(t.name, layout)) for t in out]
    if layout == "multimodal":
        out += _vision_tensors(seed, cfg.hidden_size, dtype)
    return out


# ---- writing ---------------------------------------------------------------------------------------------


def _pack(tensors: list[_Tensor], shard_bytes: int | None) -> list[list[_Tensor]]:
    """Greedy packing in file order, so a pipeline stage's layers sit in few files."""
    if shard_bytes is None:
        return [tensors]
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _write_safetensors(out_dir: Path, tensors: list[_Tensor], shard_mib: float | None) -> None:
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / INDEX_FILE]:
        # A previous run's shards would otherwise be picked up next to the new files.
        stale.unlink(missing_ok=True)
    shards = _pack(tensors, None if shard_mib is None else int(shard_mib * (1 << 20)))
    total = sum(t.nbytes for t in tensors)
    names = (
        ["model.safetensors"]
        if len(shards) == 1 and shard_mib is None
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="writing", disable=total < PROGRESS_MIN_BYTES
    ) as bar:
        for fname, shard in zip(names, shards, strict=True):
            save_file(
                {t.name: t.make().contiguous() for t in shard}, out_dir / fname, metadata={"format": "pt"}
            )
            _readable_like_the_rest(out_dir / fname)
            bar.update(sum(t.nbytes for t in shard))
    if shard_mib is not None:
        weight_map = {t.name: fname for fname, shard in zip(names, shards, strict=True) for t in shard}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _readable_like_the_rest(path: Path) -> None:
    """The mode of the directory's config.json, which open() made under the umask (safetensors writes 0600
    through a temporary file)."""
    like = path.parent / "config.json"
    path.chmod(like.stat().st_mode & 0o777 if like.is_file() else 0o644)


def _token_id(out_dir: Path, token: str) -> int:
    raw = json.loads((out_dir / "tokenizer.json").read_text())
    return next(t["id"] for t in raw["added_tokens"] if t["content"] == token)


def make_model(
    preset: str,
    out_dir: Path,
    seed: int = 0,
    layout: str = "text",
    fused_experts: bool = False,
    with_mtp: bool = True,
    shard_mib: float | None = None,
    dtype: torch.dtype = torch.float32,
    overrides: dict[str, Any] | None = None,
    quantization: str | None = None,
) -> Path:
    """Write a random checkpoint of `preset` (text fields updated by `overrides`) to out_dir and return it.

    layout "text" is transformers' Qwen4ExpForCausalLM layout (`model.*`), "multimodal" the released one
    (`model.language_model.*` plus a tiny vision tower, config `qwen4_exp` with `text_config`).
    The directory gets config.json, generation_config.json, the tokenizer and the safetensors file(s).
    `quantization="fp8"` writes the projections and experts block-wise FP8 (model/make_fp8.py).
    """
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    if layout not in ("text", "multimodal"):
        raise ValueError(f"layout must be 'text' or 'multimodal', got {layout!r}")
    text = text_config(preset, overrides)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    build_tokenizer(default_corpus(TOKENIZER_CORPUS_CHARS), text["vocab_size"], out_dir)
    eos, pad = _token_id(out_dir, IM_END), _token_id(out_dir, ENDOFTEXT)
    text = {"eos_token_id": eos} | text  # an override's eos wins

    config = _full_config(text, layout, dtype)
    if quantization == "fp8":
        config["quantization_config"] = fp8_config_json()
    cfg = ModelConfig.from_dict(config)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": text["eos_token_id"], "pad_token_id": pad, "bos_token_id": None}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    tensors = checkpoint_tensors(cfg, seed, layout, fused_experts, with_mtp, dtype)
    if quantization == "fp8":
        from .make_fp8 import quantized

        tensors = quantized(tensors, cfg)
    _write_safetensors(out_dir, tensors, shard_mib)
    return out_dir
