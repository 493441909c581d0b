"""A W4A16 checkpoint's packed modules seen as the weights they stand for: `X.weight_packed`,
`X.weight_scale`, `X.weight_shape` (and, asymmetric, `X.weight_zero_point`) read as one tensor `X.weight` of
the scales' dtype,
dequantized as compressed-tensors dequantizes it (ops/int4.py); every other tensor as it is. The loader's
recipes (per-expert stacking, shard pieces) then read a W4A16 checkpoint as they read a 16-bit one.

Each packed module is checked against the scheme and its own `weight_shape` when the checkpoint is opened
(headers and the small shape tensors only): a wrong packed or scale shape, a group size that does not divide
the input dimension, a zero point where the scheme is symmetric (or none where it is not), a packed module the
config leaves unconverted: each a ConfigError naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError
from ..ops.int4 import dequantize, packed_width
from .checkpoint import Checkpoint
from .quant import Int4Checkpoint

PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
_SCALE_DTYPES = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class _Packed:
    module: str
    n: int
    k: int
    groups: int


class UnpackedInt4:
    """A Checkpoint (the same calls) whose packed modules read as dequantized `X.weight` tensors."""

    def __init__(self, ckpt: Checkpoint, scheme: Int4Checkpoint) -> None:
        self.ckpt, self.scheme, self.dir = ckpt, scheme, ckpt.dir
        self.where: dict[str, Path] = dict(ckpt.where)
        self.packed: dict[str, _Packed] = {}
        for name in list(ckpt.where):
            if name.endswith(".weight_packed"):
                module = name[: -len(".weight_packed")]
                self.packed[module + ".weight"] = self._check(module)
                for part in PARTS:
                    self.where.pop(f"{module}.{part}", None)
                self.where[module + ".weight"] = ckpt.where[name]
        for name in ckpt.where:
            if name.rsplit(".", 1)[-1] in PARTS[1:] and name.rsplit(".", 1)[0] + ".weight" not in self.packed:
                raise ConfigError(
                    f"tensor {name!r} belongs to no packed weight ({name.rsplit('.', 1)[0]}.weight_packed)"
                )

    def _check(self, module: str) -> _Packed:
        c, s = self.ckpt, self.scheme
        packed, scale, shape_name, zero = (f"{module}.{p}" for p in PARTS)
        if not s.converted(module):
            raise ConfigError(
                f"tensor {packed!r} is packed int4 but quantization_config says {module} is not converted"
            )
        for need in (scale, shape_name):
            if need not in c.where:
                raise ConfigError(f"packed int4 tensor {packed!r} has no {need!r}")
        if c.dtype(packed) != "I32":
            raise ConfigError(f"tensor {packed!r} is {c.dtype(packed)}: packed int4 weights are int32")
        dims = c.read(shape_name).tolist()
        if len(dims) != 2 or not all(isinstance(d, int) and d > 0 for d in dims):
            raise ConfigError(f"tensor {shape_name!r} holds {dims}: a weight shape [N, K]")
        n, k = dims
        if c.shape(packed) != (n, packed_width(k)):
            raise ConfigError(
                f"tensor {packed!r} has shape {list(c.shape(packed))}, expected {[n, packed_width(k)]} "
                f"(eight 4-bit values of K = {k} to an int32)"
            )
        groups = 1 if s.group is None else k // s.group
        if s.group is not None and k % s.group:
            raise ConfigError(
                f"tensor {packed!r}: group size {s.group} does not divide its input dimension {k}"
            )
        if c.shape(scale) != (n, groups):
            raise ConfigError(f"tensor {scale!r} has shape {list(c.shape(scale))}, expected {[n, groups]}")
        if c.dtype(scale) not in _SCALE_DTYPES:
            raise ConfigError(f"tensor {scale!r} is {c.dtype(scale)}: scales are 16- or 32-bit floats")
        if s.symmetric and zero in c.where:
            raise ConfigError(f"tensor {zero!r}: the scheme is symmetric, with no zero points")
        if not s.symmetric:
            if zero not in c.where:
                raise ConfigError(f"asymmetric packed int4 tensor {packed!r} has no {zero!r}")
            if c.shape(zero) != (packed_width(n), groups) or c.dtype(zero) != "I32":
                got = [list(c.shape(zero)), c.dtype(zero)]
                raise ConfigError(f"tensor {zero!r} is {got}, expected {[[packed_width(n), groups], 'I32']}")
        return _Packed(module, n, k, groups)

    # ---- Checkpoint's calls -------------------------------------------------------------------------------
    def handle(self, path: Path):
        return self.ckpt.handle(path)

    def shape(self, name: str) -> tuple[int, ...]:
        p = self.packed.get(name)
        return (p.n, p.k) if p is not None else self.ckpt.shape(name)

    def dtype(self, name: str) -> str:
        p = self.packed.get(name)
        return self.ckpt.dtype(f"{p.module}.weight_scale") if p is not None else self.ckpt.dtype(name)

    def nbytes(self, name: str) -> int:
        p = self.packed.get(name)
        if p is None:
            return self.ckpt.nbytes(name)
        return sum(
            self.ckpt.nbytes(f"{p.module}.{part}")
            for part in PARTS
            if f"{p.module}.{part}" in self.ckpt.where
        )

    def raw(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A packed weight's words, scales and (asymmetric) zero points as ops/int4.py holds them."""
        p, c = self.packed[name], self.ckpt
        zero = None
        if not self.scheme.symmetric:
            from ..ops.int4 import unpack_int4

            zero = unpack_int4(c.read(f"{p.module}.weight_zero_point").T.contiguous(), p.n).T
        return c.read(f"{p.module}.weight_packed"), c.read(f"{p.module}.weight_scale"), zero

    def read(self, name: str) -> torch.Tensor:
        if name not in self.packed:
            return self.ckpt.read(name)
        packed, scale, zero = self.raw(name)
        # NOTE: in the scales' dtype, as the library computes the weight (ops/int4.py); the loader's copy
        # into the model dtype is exact from a 16-bit weight into float32 or float64
        return dequantize(packed, scale, zero, self.packed[name].k, scale.dtype)
