"""4-bit integer weights with 16-bit activations (W4A16), in compressed-tensors' `pack-quantized` layout as
llm-compressor writes it and vLLM reads it:

- `packed` int32 [..., N, ceil(K/8)]: eight 4-bit values along the input dimension K to a word, value i of a
  word in bits 4i..4i+3 (lowest first), each stored plus 8 (so -8..7 is 0..15);
- `scale` [..., N, K / G] in the model's 16-bit dtype, one per group of G input columns (G = K: a channel);
- `zero` int8 [..., N, K / G] or None: the zero point of asymmetric weights (symmetric ones have none);
- the weight is w = (q - zero) * scale.

`dequantize` is the reference every int4 path is checked against (C4), itself checked against the
compressed-tensors library's own unpacking and dequantization (tests/ops/test_int4.py): values times scales
rounded once to the scale's dtype, as the library computes a weight (a bf16 scale: bf16 weights, whatever
the activations' dtype), then taken to the activations' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = 4
PER_WORD = 32 // BITS  # values in one int32 word
QMIN, QMAX = -(1 << (BITS - 1)), (1 << (BITS - 1)) - 1  # -8, 7
OFFSET = 1 << (BITS - 1)  # stored value = q + 8


def packed_width(k: int) -> int:
    """Words a row of k 4-bit values packs into."""
    return -(-k // PER_WORD)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7] [..., K] -> int32 words [..., ceil(K/8)] (the module docstring's layout)."""
    *lead, k = q.shape
    width = packed_width(k)
    u = (q.to(torch.int32) + OFFSET).reshape(-1, k)
    u = torch.nn.functional.pad(u, (0, width * PER_WORD - k)).reshape(-1, width, PER_WORD)
    shifts = torch.arange(PER_WORD, dtype=torch.int32, device=q.device) * BITS
    # NOTE: the top value's bits reach bit 31, the sign bit: the sum of disjoint bit fields is the int32
    # with those bits (two's complement wraps), as the format's words are
    words = (u << shifts).sum(dim=-1, dtype=torch.int64)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.reshape(*lead, width)


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """int32 words [..., W] -> int8 values [..., k] in [-8, 7]."""
    shifts = torch.arange(PER_WORD, dtype=torch.int32, device=packed.device) * BITS
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., W, 8]
    return (nibbles.flatten(-2)[..., :k] - OFFSET).to(torch.int8)


@dataclass(frozen=True, eq=False)
class Int4Weight:
    """A weight [..., N, K] in 4 bits (module docstring); what the ops take where they take a weight."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    k: int  # the input dimension (the packed rows may hold up to 7 values of padding)

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.int32:
            raise ValueError(f"packed int4 weights are int32 words, got {self.packed.dtype}")
        *lead, n, width = self.packed.shape
        if width != packed_width(self.k):
            raise ValueError(
                f"packed width {width} does not hold {self.k} 4-bit values ({packed_width(self.k)})"
            )
        groups = self.scale.shape[-1]
        if tuple(self.scale.shape[:-1]) != (*lead, n) or groups < 1 or self.k % groups:
            raise ValueError(
                f"scale shape {list(self.scale.shape)} does not fit weights {[*lead, n, self.k]}"
            )
        if self.zero is not None and self.zero.shape != self.scale.shape:
            raise ValueError(f"zero-point shape {list(self.zero.shape)} is not the scale's")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], self.k))

    @property
    def group(self) -> int:
        return self.k // self.scale.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.packed, self.scale, self.zero, self.k, dtype)

    def __getitem__(self, e: int) -> Int4Weight:
        """Expert e of stacked expert weights [E, N, K]."""
        return Int4Weight(self.packed[e], self.scale[e], None if self.zero is None else self.zero[e], self.k)


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, k: int, dtype: torch.dtype
) -> torch.Tensor:
    """(q - zero) * scale per group, rounded once to the scale's dtype (the weight's value, as the
    compressed-tensors library dequantizes it: a bf16 scale gives bf16 weights whatever the activations),
    then given `dtype` (exactly, for float32 and float64)."""
    wide = torch.float64 if scale.dtype == torch.float64 else torch.float32
    q = unpack_int4(packed, k).to(wide)  # [..., N, K]
    group = k // scale.shape[-1]
    if zero is not None:
        q = q - zero.to(wide).repeat_interleave(group, dim=-1)
    return (q * scale.to(wide).repeat_interleave(group, dim=-1)).to(scale.dtype).to(dtype)


def quantize_int4(w: torch.Tensor, group: int = 128, scale_dtype: torch.dtype | None = None) -> Int4Weight:
    """Round-to-nearest symmetric int4 of w [..., N, K] in groups of `group` input columns, as
    llm-compressor's default (min-max) observer and compressed-tensors' quantizer make it: scale = the
    group's largest |w| / 7.5 (kept in `scale_dtype`, the weight's own by default), q = round(w / scale) in
    [-8, 7]."""
    *lead, n, k = w.shape
    if k % group:
        raise ValueError(f"group size {group} does not divide the input dimension {k}")
    scale_dtype = scale_dtype or w.dtype
    groups = w.unflatten(-1, (k // group, group))  # [..., N, K/G, G]
    amax = groups.float().abs().amax(dim=-1)
    scale = (amax / ((QMAX - QMIN) / 2)).to(scale_dtype)  # rounded to its dtype before it divides
    # NOTE: w / scale in the weight's dtype (a bf16 quotient is rounded before it is rounded to an integer),
    # as compressed-tensors' quantizer divides: the same codes as a checkpoint it writes
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).to(w.dtype).unsqueeze(-1)
    q = torch.round(groups / divisor).clamp(QMIN, QMAX).to(torch.int8).flatten(-2)
    return Int4Weight(pack_int4(q), scale, None, k)
