"""Write random Flash-Next checkpoints in Hugging Face layout, for tests and benchmarks.

A checkpoint made here loads in transformers (`Qwen4ExpForCausalLM` for the text layout,
`Qwen4ExpForConditionalGeneration` for the multimodal one) with no missing or unexpected keys, so it serves
as the shared input of nextserve and the transformers oracle. Every tensor is drawn from its own generator,
seeded by (seed, tensor name): values do not depend on layout, sharding, expert fusion or MTP.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from nextserve.config import ModelConfig
from nextserve.model.checkpoint import INDEX_FILE
from nextserve.model.loader import PROGRESS_MIN_BYTES
from nextserve.model.presets import full_config, preset_overrides, text_config
from nextserve.model.quant import fp8_config_json, int4_config_json
from nextserve.model.random_tensors import PlannedTensor, checkpoint_tensors, initial_values, seed_for
from nextserve.model.tokenizer_build import ENDOFTEXT, IM_END, build_tokenizer, default_corpus

TOKENIZER_CORPUS_CHARS = 400_000  # enough text for a few thousand merges; trains in well under a second

# NOTE: the reference checkpoint recipe (benchmarks/reference/make_ckpt.py, a copy of the one the project is
# compared on, which this repository does not own) imports checkpoint_tensors, preset_overrides, text_config
# and these three, by their former names, from this module.
_full_config, _init, _seed_for = full_config, initial_values, seed_for
__all__ = [
    "make_model",
    "token_id",
    "write_configs",
    "write_safetensors",
    "checkpoint_tensors",
    "preset_overrides",
    "text_config",
]


def _pack(tensors: list[PlannedTensor], shard_bytes: int | None) -> list[list[PlannedTensor]]:
    """Greedy packing in file order, so a pipeline stage's layers sit in few files."""
    if shard_bytes is None:
        return [tensors]
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def write_safetensors(out_dir: Path, tensors: list[PlannedTensor], shard_mib: float | None) -> None:
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


def write_configs(out_dir: Path, config: dict[str, Any], eos: int, pad: int) -> None:
    """config.json, and generation_config.json with the eos and pad ids (no bos)."""
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def token_id(out_dir: Path, token: str) -> int:
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
    group_size: int = 128,
) -> Path:
    """Write a random checkpoint of `preset` (text fields updated by `overrides`) to out_dir and return it.

    layout "text" is transformers' Qwen4ExpForCausalLM layout (`model.*`), "multimodal" the released one
    (`model.language_model.*` plus a tiny vision tower, config `qwen4_exp` with `text_config`).
    The directory gets config.json, generation_config.json, the tokenizer and the safetensors file(s).
    `quantization="fp8"` writes the projections and experts block-wise FP8 (model/make_fp8.py); "int4" writes
    them W4A16 in groups of `group_size` input columns (model/make_int4.py).
    """
    if quantization not in (None, "fp8", "int4"):
        raise ValueError(f"quantization must be None, 'fp8' or 'int4', got {quantization!r}")
    if layout not in ("text", "multimodal"):
        raise ValueError(f"layout must be 'text' or 'multimodal', got {layout!r}")
    text = text_config(preset, overrides)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    build_tokenizer(default_corpus(TOKENIZER_CORPUS_CHARS), text["vocab_size"], out_dir)
    eos, pad = token_id(out_dir, IM_END), token_id(out_dir, ENDOFTEXT)
    text = {"eos_token_id": eos} | text  # an override's eos wins

    config = full_config(text, layout, dtype)
    if quantization == "fp8":
        config["quantization_config"] = fp8_config_json()
    elif quantization == "int4":
        config["quantization_config"] = int4_config_json(group_size)
    cfg = ModelConfig.from_dict(config)
    write_configs(out_dir, config, text["eos_token_id"], pad)

    tensors = checkpoint_tensors(cfg, seed, layout, fused_experts, with_mtp, dtype)
    if quantization == "fp8":
        from .make_fp8 import quantized

        tensors = quantized(tensors, cfg)
    elif quantization == "int4":
        from .make_int4 import quantized as quantized_int4

        tensors = quantized_int4(tensors, cfg, group_size)
    write_safetensors(out_dir, tensors, shard_mib)
    return out_dir
