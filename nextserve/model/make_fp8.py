"""`make-model --quantization fp8`: a checkpoint's projections and experts as block-wise FP8, in the format of
Qwen's and DeepSeek's FP8 releases (model/quant.py): `X.weight` float8_e4m3fn, `X.weight_scale_inv` float32
(one multiplier a 128 x 128 block), a `quantization_config` naming what stays unquantized."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from ..config import ModelConfig
from ..ops.fp8 import FP8, quantize, scale_shape
from .loader import model_fp8_capable
from .quant import default_fp8

_EXPERT = re.compile(r"^(?P<base>.+\.mlp\.experts)\.\d+\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def runtime_name(ckpt_name: str) -> str:
    """The runtime tensor a checkpoint tensor fills (model/shapes.py's names)."""
    name = re.sub(r"^model\.(language_model\.)?", "", ckpt_name)
    name = re.sub(r"^mtp\.layers\.0\.", "mtp.layer.", name)
    m = _EXPERT.match(name)
    if m:
        return f"{m['base']}.{'down_proj' if m['proj'] == 'down_proj' else 'gate_up_proj'}"
    return name


def quantized(tensors: list, cfg: ModelConfig) -> list:
    """The tensors (random_tensors.PlannedTensor: name, shape, dtype, make) with each projection and expert
    weight that `default_fp8` converts replaced by its FP8 values and scales, next to each other in file
    order."""
    capable, scheme = model_fp8_capable(cfg), default_fp8()
    out = []
    for t in tensors:
        module = t.name[: -len(".weight")] if t.name.endswith(".weight") else t.name
        if runtime_name(t.name) not in capable or not scheme.converted(module):
            out.append(t)
            continue
        pair, scale = _Quantized(t.make), scheme.scale_name(t.name)
        out.append(replace(t, dtype=FP8, make=pair.values))
        out.append(replace(t, name=scale, shape=scale_shape(t.shape), dtype=torch.float32, make=pair.scales))
    return out


@dataclass
class _Quantized:
    """One tensor's quantization, computed once for its two outputs (values first, then scales)."""

    make: object
    done: tuple[torch.Tensor, torch.Tensor] | None = None

    def values(self) -> torch.Tensor:
        self.done = quantize(self.make())
        return self.done[0]

    def scales(self) -> torch.Tensor:
        q, s = self.done if self.done is not None else quantize(self.make())
        self.done = None  # the pair is written: let it go
        return s
