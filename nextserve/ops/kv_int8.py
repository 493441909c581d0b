"""8-bit KV planes (--kv-dtype int8): int8 values with one float32 scale per stored vector (a token's head in
the K and V planes, a block's compressed indexer key), symmetric round-to-nearest: scale = max|x| / 127,
q = round(x / scale) in [-127, 127]; read back as q * scale in float32, rounded once to the model dtype.

# NOTE: a vector's stored form depends on that vector alone (written once, never requantized as its page
# fills), so every speed mode that writes the same vectors reads the same values back: C1 holds among
# modes of one KV dtype. A scale per vector, not per page: a page-wide scale would have to be fixed before
# the page's later tokens exist, or requantize them. The scales cost 4 bytes a vector (1.6% of a K head of
# 256 values).
"""

from __future__ import annotations

import torch

QMAX = 127
KV_DTYPES = ("auto", "bf16", "int8")  # --kv-dtype: auto and bf16 keep the model dtype


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 values [..., D], float32 scales [...])."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # NOTE: a tensor divisor, never the scalar 127: CUDA divides by a scalar as a product with its
    # reciprocal, which the paged-write kernel (ops/triton/paged.py, an IEEE division) would not match
    scale = amax / torch.full_like(amax, QMAX)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    q = torch.round(xf / divisor).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(int8 values [..., D], float32 scales [...]) -> [..., D] in dtype."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


class Int8Plane:
    """One layer's 8-bit plane as the ops read and write it: values [pages, P, ..., D] int8 and scales
    [pages, P, ...] float32, views of the pool's. Indexing gathers and dequantizes to `dtype`; item
    assignment and `index_put_` quantize what is stored. The ops take it where they take a plane: their
    PyTorch paths through this indexing, the QSA kernels reading values and scales (ops/triton/kv_int8.py);
    decode rows' writes on CUDA quantize in the paged-write kernel (ops/triton/paged.py), with these bits."""

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        assert values.dtype == torch.int8 and scale.shape == values.shape[:-1], (values.dtype, scale.shape)
        self.values, self.scale, self.dtype = values, scale, dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def is_cuda(self) -> bool:
        return self.values.is_cuda

    def is_contiguous(self) -> bool:
        return False  # (not one tensor: the kernels' contiguous fast paths do not apply)

    def __getitem__(self, index) -> torch.Tensor:
        return dequantize_rows(self.values[index], self.scale[index], self.dtype)

    def __setitem__(self, index, x: torch.Tensor) -> None:
        q, s = quantize_rows(x)
        self.values[index] = q
        self.scale[index] = s

    def index_put_(self, indices: tuple[torch.Tensor, ...], x: torch.Tensor) -> Int8Plane:
        q, s = quantize_rows(x)
        self.values.index_put_(indices, q)
        self.scale.index_put_(indices, s)
        return self
