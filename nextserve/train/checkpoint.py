"""Write trained weights as a Hugging Face Flash-Next checkpoint, with make_model's names and layout
(fused experts, PLE tables as `ngram_embedding.shard_{i}` plus their index buffers, `mtp.layers.0.*`)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import torch

from ..config import ModelConfig
from ..model.make_model import token_id, write_configs, write_safetensors
from ..model.presets import full_config
from ..model.random_tensors import checkpoint_tensors
from ..model.tokenizer_build import ENDOFTEXT, IM_END

_SHARD = re.compile(r"^(?P<base>.+\.ngram_embedding)\.shard_(?P<i>\d+)\.weight$")


def write_checkpoint(
    state: dict[str, torch.Tensor], text_config: dict, out_dir: Path, dtype: torch.dtype = torch.bfloat16
) -> ModelConfig:
    """state: runtime-named tensors (train/model.runtime_state). out_dir must already hold the
    tokenizer (its <|im_end|> id is the eos). Writes config.json, generation_config.json and
    model.safetensors; returns the ModelConfig."""
    out_dir = Path(out_dir)
    eos, pad = token_id(out_dir, IM_END), token_id(out_dir, ENDOFTEXT)
    text = {"eos_token_id": eos} | text_config
    config = full_config(text, "text", dtype)
    cfg = ModelConfig.from_dict(config)
    write_configs(out_dir, config, eos, pad)
    tensors, row = [], {}
    for t in checkpoint_tensors(cfg, 0, "text", fused_experts=True, with_mtp=True, dtype=dtype):
        rt = t.name.removeprefix("model.")
        if rt.startswith("mtp.layers.0."):
            rt = "mtp.layer." + rt[len("mtp.layers.0.") :]
        m = _SHARD.match(rt)
        if m:
            base = m["base"]
            start = row.get(base, 0)
            value = state[f"{base}.weight"][start : start + t.shape[0]]
            row[base] = start + t.shape[0]
        elif rt in state:
            value = state[rt]
        elif rt == "mtp.hyper_connection_mixer.block_inject_weight.weight":
            value = torch.zeros(t.shape)  # unused by every loader; kept for the released layout
        else:
            tensors.append(t)  # PLE index buffers: recomputed from the config, written as make_model does
            continue
        if tuple(value.shape) != tuple(t.shape):
            raise ValueError(f"{t.name}: trained shape {tuple(value.shape)} != {tuple(t.shape)}")
        tensors.append(replace(t, make=lambda v=value: v.detach().to("cpu", dtype).contiguous()))
    write_safetensors(out_dir, tensors, None)
    return cfg
