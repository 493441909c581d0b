"""8-bit KV planes (--kv-dtype int8 or fp8): 8-bit codes with one float32 scale per stored vector (a token's
head in the K and V planes, a block's compressed indexer key), symmetric: scale = max|x| / QMAX and the codes
x / scale rounded, int8 to the nearest integer in [-127, 127] (QMAX 127), fp8 to the nearest E4M3 value in
[-448, 448] (QMAX 448; ties to even both); read back as codes * scale in float32, rounded once to the model
dtype. int8 spaces its codes evenly (absolute error up to scale / 2); E4M3 keeps 3 mantissa bits at every
magnitude (relative error up to 2^-4), which favours vectors with a few large values.

# NOTE: a vector's stored form depends on that vector alone (written once, never requantized as its page
# fills), so every speed mode that writes the same vectors reads the same values back: C1 holds among
# modes of one KV dtype. A scale per vector, not per page: a page-wide scale would have to be fixed before
# the page's later tokens exist, or requantize them. The scales cost 4 bytes a vector (1.6% of a K head of
# 256 values). The pool stores both forms' codes as int8 bytes (page copies and host images move bytes);
# a plane views them as its codes.
"""

from __future__ import annotations

import torch

KV_DTYPES = ("auto", "bf16", "int8", "fp8")  # --kv-dtype: auto and bf16 keep the model dtype
CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # the 8-bit forms' code dtypes
QMAXES = {"int8": 127.0, "fp8": 448.0}
QMAX = QMAXES["int8"]


def form_of(codes: torch.dtype) -> str:
    return next(form for form, dtype in CODES.items() if dtype == codes)


def quantize_rows(x: torch.Tensor, form: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] of `form`'s dtype, float32 scales [...])."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    qmax = QMAXES[form]
    # NOTE: a tensor divisor, never the scalar QMAX: CUDA divides by a scalar as a product with its
    # reciprocal, which the paged-write kernel (ops/triton/paged.py, an IEEE division) would not match
    scale = amax / torch.full_like(amax, qmax)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    v = xf / divisor
    if form == "fp8":
        return v.clamp(-qmax, qmax).to(CODES[form]), scale
    return torch.round(v).clamp(-qmax, qmax).to(torch.int8), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(codes [..., D] (int8 or E4M3), float32 scales [...]) -> [..., D] in dtype."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


class Kv8Plane:
    """One layer's 8-bit plane as the ops read and write it: codes `values` [pages, P, ..., D] (int8 or
    E4M3, a view of the pool's int8 bytes) and scales [pages, P, ...] float32, views of the pool's. Indexing
    gathers and dequantizes to `dtype`; item assignment and `index_put_` quantize what is stored. The ops
    take it where they take a plane: their PyTorch paths through this indexing, the QSA kernels reading
    codes and scales (ops/triton/kv8.py); decode rows' writes on CUDA quantize in the paged-write kernel
    (ops/triton/paged.py), with these bits."""

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        assert values.dtype in CODES.values() and scale.shape == values.shape[:-1], (
            values.dtype,
            scale.shape,
        )
        self.values, self.scale, self.dtype = values, scale, dtype
        self.form = form_of(values.dtype)

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
        codes = self.values.view(torch.int8)[index].view(self.values.dtype)
        return dequantize_rows(codes, self.scale[index], self.dtype)

    def __setitem__(self, index, x: torch.Tensor) -> None:
        q, s = quantize_rows(x, self.form)
        self.values.view(torch.int8)[index] = q.view(torch.int8)  # (bytes: any code dtype)
        self.scale[index] = s

    def index_put_(self, indices: tuple[torch.Tensor, ...], x: torch.Tensor) -> Kv8Plane:
        q, s = quantize_rows(x, self.form)
        self.values.view(torch.int8).index_put_(indices, q.view(torch.int8))
        self.scale.index_put_(indices, s)
        return self
