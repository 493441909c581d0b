"""`make-model --quantization int4`: a checkpoint's projections and experts as W4A16, in compressed-tensors'
pack-quantized format as llm-compressor writes it (model/quant.py `int4_config_json`, ops/int4.py): for each
quantized `X.weight`, `X.weight_packed` (int32), `X.weight_scale` (the model dtype) and `X.weight_shape`,
round-to-nearest symmetric int4 in groups of `group` input columns."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config import ModelConfig
from ..ops.int4 import Int4Weight, packed_width, quantize_int4
from .loader import model_fp8_capable
from .make_fp8 import runtime_name
from .quant import DEFAULT_NOT_CONVERTED, Int4Checkpoint


def quantized(tensors: list, cfg: ModelConfig, group: int, strict: bool = True) -> list:
    """The tensors (random_tensors.PlannedTensor) with each 2-D projection and per-expert weight that the
    scheme converts replaced by its packed values, scales and shape, next to each other in file order. A
    weight whose input dimension the group does not divide is an error, or with `strict` False stays as it
    is (as --quantization int4 leaves it on load)."""
    capable = model_fp8_capable(cfg)  # (the projections and experts: the tensors a weight kernel reads)
    scheme = Int4Checkpoint(group, True, tuple(DEFAULT_NOT_CONVERTED))
    out = []
    for t in tensors:
        module = t.name[: -len(".weight")] if t.name.endswith(".weight") else t.name
        if (
            runtime_name(t.name) not in capable
            or not scheme.converted(module)
            or not t.name.endswith(".weight")
        ):
            out.append(t)
            continue
        if len(t.shape) != 2:
            raise ValueError(f"{t.name}: int4 checkpoints are written with per-expert (2-D) weights only")
        n, k = t.shape
        if k % group and not strict:
            out.append(t)
            continue
        if k % group:
            raise ValueError(f"{t.name}: group size {group} does not divide its input dimension {k}")
        q = _Quantized(t.make, group)
        out.append(replace(t, name=module + ".weight_packed", shape=(n, packed_width(k)), dtype=torch.int32,
                           make=q.packed))  # fmt: skip
        out.append(replace(t, name=module + ".weight_scale", shape=(n, k // group), make=q.scale))
        out.append(replace(t, name=module + ".weight_shape", shape=(2,), dtype=torch.int64,
                           make=lambda n=n, k=k: torch.tensor([n, k], dtype=torch.int64)))  # fmt: skip
    return out


@dataclass
class _Quantized:
    """One tensor's quantization, computed once for its outputs (packed values first, then scales)."""

    make: object
    group: int
    done: Int4Weight | None = None

    def packed(self) -> torch.Tensor:
        self.done = quantize_int4(self.make(), self.group)
        return self.done.packed

    def scale(self) -> torch.Tensor:
        w = self.done if self.done is not None else quantize_int4(self.make(), self.group)
        self.done = None  # the tensors are written: let them go
        return w.scale


def quantize_checkpoint(src: Path, out: Path, group: int = 128) -> Path:
    """A plain checkpoint directory written again as W4A16 (what `quantized` converts, the rest as it is;
    config and tokenizer files copied, the config given its quantization_config): round-to-nearest, as
    llm-compressor's one-shot RTN writes it."""
    import json
    import shutil

    from safetensors import safe_open

    from .make_model import write_safetensors
    from .quant import int4_config_json
    from .random_tensors import PlannedTensor

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".index.json")):
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = int4_config_json(group)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = []
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                tensors.append(PlannedTensor(name, tuple(t.shape), t.dtype, lambda t=t: t))
    write_safetensors(out, quantized(tensors, ModelConfig.from_dir(src), group, strict=False), None)
    return out
