"""A W4A16 checkpoint's packed modules seen as the weights they stand for: compressed-tensors'
`X.weight_packed`, `X.weight_scale`, `X.weight_shape` (and, asymmetric, `X.weight_zero_point`), or GPTQ's
`X.qweight`, `X.qzeros`, `X.scales`, `X.g_idx` (model/quant.py Int4Checkpoint), read as one tensor `X.weight`
of the scales' dtype, dequantized as the format's library dequantizes it (ops/int4.py); every other tensor as
it is. The loader's recipes (per-expert stacking, shard pieces) then read a W4A16 checkpoint as they read a
16-bit one, and `raw` gives a module's words, scales and zero points in ops/int4.py's layout to keep it int4
in memory.

Each packed module is checked against the scheme and its own shapes when the checkpoint is opened (headers
and compressed-tensors' small shape tensors only): a wrong packed or scale shape, a group size that does not
divide the input dimension, a zero point where the scheme is symmetric (or none where it is not), a packed
module the config leaves unconverted: each a ConfigError naming the tensor. GPTQ's zero points and g_idx are
checked when read: a symmetric checkpoint's zero points must be the midpoint 8, and g_idx the plain
k // group (no activation order).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError
from ..ops.int4 import OFFSET, dequantize, packed_width, unpack_int4
from .checkpoint import Checkpoint
from .quant import Int4Checkpoint

PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
GPTQ_PARTS = ("qweight", "scales", "qzeros", "g_idx")
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
        self.gptq = scheme.fmt.startswith("gptq")
        self.parts = GPTQ_PARTS if self.gptq else PARTS
        self.where: dict[str, Path] = dict(ckpt.where)
        self.packed: dict[str, _Packed] = {}
        first = "." + self.parts[0]
        for name in list(ckpt.where):
            if name.endswith(first):
                module = name[: -len(first)]
                self.packed[module + ".weight"] = (
                    self._check_gptq(module) if self.gptq else self._check(module)
                )
                for part in self.parts:
                    self.where.pop(f"{module}.{part}", None)
                self.where[module + ".weight"] = ckpt.where[name]
        for name in ckpt.where:
            module, part = name.rsplit(".", 1) if "." in name else ("", name)
            if part in self.parts[1:] and module + ".weight" not in self.packed:
                raise ConfigError(f"tensor {name!r} belongs to no packed weight ({module}{first})")

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
        groups = self._groups(packed, k)
        if c.shape(scale) != (n, groups):
            raise ConfigError(f"tensor {scale!r} has shape {list(c.shape(scale))}, expected {[n, groups]}")
        self._check_scale_dtype(scale)
        if s.symmetric and zero in c.where:
            raise ConfigError(f"tensor {zero!r}: the scheme is symmetric, with no zero points")
        if not s.symmetric:
            if zero not in c.where:
                raise ConfigError(f"asymmetric packed int4 tensor {packed!r} has no {zero!r}")
            if c.shape(zero) != (packed_width(n), groups) or c.dtype(zero) != "I32":
                got = [list(c.shape(zero)), c.dtype(zero)]
                raise ConfigError(f"tensor {zero!r} is {got}, expected {[[packed_width(n), groups], 'I32']}")
        return _Packed(module, n, k, groups)

    def _check_gptq(self, module: str) -> _Packed:
        c = self.ckpt
        qweight, scales, qzeros, g_idx = (f"{module}.{p}" for p in GPTQ_PARTS)
        for need in (scales, qzeros):
            if need not in c.where:
                raise ConfigError(f"GPTQ tensor {qweight!r} has no {need!r}")
        for name in (qweight, qzeros):
            if c.dtype(name) != "I32":
                raise ConfigError(f"tensor {name!r} is {c.dtype(name)}: GPTQ packs 4-bit values into int32")
        if len(c.shape(qweight)) != 2:
            raise ConfigError(f"tensor {qweight!r} has shape {list(c.shape(qweight))}: [K / 8, N]")
        words, n = c.shape(qweight)
        k = words * 8
        groups = self._groups(qweight, k)
        if c.shape(scales) != (groups, n):
            raise ConfigError(f"tensor {scales!r} has shape {list(c.shape(scales))}, expected {[groups, n]}")
        self._check_scale_dtype(scales)
        if c.shape(qzeros) != (groups, packed_width(n)):
            raise ConfigError(
                f"tensor {qzeros!r} has shape {list(c.shape(qzeros))}, expected {[groups, packed_width(n)]}"
            )
        if g_idx in c.where and c.shape(g_idx) != (k,):
            raise ConfigError(f"tensor {g_idx!r} has shape {list(c.shape(g_idx))}, expected {[k]}")
        return _Packed(module, n, k, groups)

    def _groups(self, packed: str, k: int) -> int:
        group = self.scheme.group
        if group is not None and k % group:
            raise ConfigError(
                f"tensor {packed!r}: group size {group} does not divide its input dimension {k}"
            )
        return 1 if group is None else k // group

    def _check_scale_dtype(self, scale: str) -> None:
        if self.ckpt.dtype(scale) not in _SCALE_DTYPES:
            raise ConfigError(
                f"tensor {scale!r} is {self.ckpt.dtype(scale)}: scales are 16- or 32-bit floats"
            )

    # ---- Checkpoint's calls -------------------------------------------------------------------------------
    def handle(self, path: Path):
        return self.ckpt.handle(path)

    def shape(self, name: str) -> tuple[int, ...]:
        p = self.packed.get(name)
        return (p.n, p.k) if p is not None else self.ckpt.shape(name)

    def dtype(self, name: str) -> str:
        p = self.packed.get(name)
        return self.ckpt.dtype(f"{p.module}.{self.parts[1]}") if p is not None else self.ckpt.dtype(name)

    def nbytes(self, name: str) -> int:
        p = self.packed.get(name)
        if p is None:
            return self.ckpt.nbytes(name)
        names = (f"{p.module}.{part}" for part in self.parts)
        return sum(self.ckpt.nbytes(n) for n in names if n in self.ckpt.where)

    def raw(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A packed weight's words, scales and (asymmetric) zero points as ops/int4.py holds them."""
        p, c = self.packed[name], self.ckpt
        if self.gptq:
            return self._raw_gptq(p)
        zero = None
        if not self.scheme.symmetric:
            zero = unpack_int4(c.read(f"{p.module}.weight_zero_point").T.contiguous(), p.n).T
        return c.read(f"{p.module}.weight_packed"), c.read(f"{p.module}.weight_scale"), zero

    def _raw_gptq(self, p: _Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """GPTQ's tensors in ops/int4.py's layout. Its words hold the stored values 0..15 of eight input
        rows, lowest bits first: the transposed words are ops/int4.py's (value + 8 stored). Its weight is
        (stored - zero) * scale, so ops/int4.py's zero point is zero - 8, where zero is the stored zero plus
        one ("gptq") or as stored ("gptq_v2")."""
        c, module = self.ckpt, p.module
        g_idx = f"{module}.g_idx"
        if g_idx in c.where:
            group = p.k // p.groups
            plain = torch.arange(p.k, dtype=torch.int64) // group
            if not torch.equal(c.read(g_idx).to(torch.int64), plain):
                raise ConfigError(
                    f"tensor {g_idx!r} is not k // {group}: activation-ordered (desc_act) weights are not "
                    "read"
                )
        words = c.read(f"{module}.qweight").T.contiguous()
        scale = c.read(f"{module}.scales").T.contiguous()
        stored = unpack_int4(c.read(f"{module}.qzeros"), p.n).to(torch.int16) + OFFSET  # [G, N] 0..15
        zero = (stored + (1 if self.scheme.fmt == "gptq" else 0) - OFFSET).T.contiguous()  # [N, G]
        if self.scheme.symmetric:
            if zero.any():
                raise ConfigError(
                    f"tensor {module + '.qzeros'!r}: the scheme is symmetric (sym true) but its zero points "
                    "are not the midpoint 8"
                )
            return words, scale, None
        return words, scale, zero.to(torch.int8)

    def read(self, name: str) -> torch.Tensor:
        if name not in self.packed:
            return self.ckpt.read(name)
        packed, scale, zero = self.raw(name)
        # NOTE: in the scales' dtype, as the library computes the weight (ops/int4.py); the loader's copy
        # into the model dtype is exact from a 16-bit weight into float32 or float64
        return dequantize(packed, scale, zero, self.packed[name].k, scale.dtype)
