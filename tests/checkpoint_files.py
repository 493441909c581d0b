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


def w4a16_converted(name: str, t: torch.Tensor) -> bool:
    """What the W4A16 recipes (llm-compressor's, GPTQ's) quantize here: the decoder's 2-D Linear weights but
    the routers, gates, norms, embeddings, the n-gram table and the hyper-connection weights."""
    if not name.endswith(".weight") or t.dim() != 2 or "norm" in name or "embed" in name:
        return False
    return not any(
        s in name for s in ("lm_head", "mlp.gate.", "shared_expert_gate", "ngram", "hyper_connection")
    )


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


def logit_error_against_transformers(
    model_dir: Path, hf_dir: Path, prompt: list[int]
) -> tuple[float, set[str]]:
    """(the largest difference of nextserve's float32 logits of `model_dir` from transformers' of `hf_dir`,
    relative to transformers' largest logit; the runtime names nextserve holds quantized)."""
    from hf_oracle import new_sequence
    from transformers import Qwen4ExpForCausalLM

    from nextserve.config import ModelConfig
    from nextserve.model.batch import ForwardBatch, SeqChunk
    from nextserve.model.flash_next import FlashNext
    from nextserve.model.loader import load_module, meta_device

    cfg = ModelConfig.from_dir(model_dir)
    with meta_device():
        model = FlashNext(cfg)
    held = load_module(model, model_dir, cfg, torch.float32, torch.device("cpu"))
    model.prepare()
    hf = Qwen4ExpForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    hf.set_experts_implementation("eager")
    ids = torch.tensor(prompt)
    seq = new_sequence(cfg, torch.float32, len(prompt))
    with torch.no_grad():
        streams = model(ForwardBatch(ids, torch.arange(len(prompt)), [SeqChunk(seq, 0, len(prompt))], False))
        ours = model.logits(streams)
        ref = hf(ids[None]).logits[0]
    return ((ours - ref).abs().max() / ref.abs().max()).item(), held
