"""Checkpoint directories the quantized-format tests write: a source directory's files with new tensors and a
new quantization_config."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out |= load_file(f)
    return out


def write_checkpoint(
    out: Path, src: Path, tensors: dict[str, torch.Tensor], qc: dict | None, shards: int = 1
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if not f.name.endswith(".safetensors") and not f.name.endswith(".index.json"):
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    if qc is not None:
        config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, out / fname)
        weight_map |= {n: fname for n in part}
    if shards > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out
