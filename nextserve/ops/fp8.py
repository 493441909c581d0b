"""Block-wise FP8 weights: E4M3 values with one float32 multiplier per 128 x 128 block (w ~= q * s), the
format of Qwen's and DeepSeek's FP8 releases (`weight_scale_inv`) and of compressed-tensors' FP8_BLOCK
(`weight_scale`, the same multiplier).

FP8 is a storage format here: kernels read the FP8 values in registers, activations stay in the model
dtype. `dequantize` is the reference every FP8 kernel is checked against (C4) and the CPU path: each
block's values times its scale in float32 (float64 when asked: exact), rounded once to the activations'
dtype, then the op runs as on unquantized weights. The grouped-expert kernels dequantize each tile the
same way and then compute as their 16-bit twins do: in float32 (and in Triton's interpreter) that gives
the twin's bits on the dequantized weights; in 16-bit dtypes on the H200 the compiler lowers a dot fed
from registers differently from one fed from memory, so there it is close, not equal. The small-M GEMV
instead multiplies the codes and scales each tile's float32 partial per column (ops/triton/gemv.py
`_weight_args`): close to the reference, not its bits (tests/ops/test_fp8_kernels.py). Rows stay
invariant either way: the tiling is a function of the weight's shape alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
BLOCK = 128  # rows and columns of one scale block
FP8_MAX = 448.0  # the largest finite E4M3 value


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scale tensor's shape for weights of `shape` [..., N, K]: [..., ceil(N/128), ceil(K/128)]."""
    *lead, n, k = shape
    return (*lead, -(-n // BLOCK), -(-k // BLOCK))


@dataclass(frozen=True, eq=False)
class Fp8Weight:
    """A weight [..., N, K] stored as `q` (float8_e4m3fn) and `scale` ([..., ceil(N/128), ceil(K/128)]
    float32), what the ops take where they take a weight tensor."""

    q: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.q.dtype != FP8:
            raise ValueError(f"FP8 weights are float8_e4m3fn, got {self.q.dtype}")
        if tuple(self.scale.shape) != scale_shape(tuple(self.q.shape)):
            raise ValueError(
                f"scale shape {list(self.scale.shape)} does not fit weights {list(self.q.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.q, self.scale, dtype)

    def __getitem__(self, e: int) -> Fp8Weight:
        """Expert e of stacked expert weights [E, N, K]."""
        return Fp8Weight(self.q[e], self.scale[e])

    def rows(self, start: int, stop: int) -> Fp8Weight:
        """Rows start..stop-1 (start a multiple of 128, so whole scale blocks come along)."""
        assert start % BLOCK == 0, start
        return Fp8Weight(self.q[..., start:stop, :], self.scale[..., start // BLOCK : -(-stop // BLOCK), :])


def expand_scale(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A scale [..., ceil(n/128), ceil(k/128)] repeated to one value per weight [..., n, k]."""
    s = scale.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return s[..., :n, :k]


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * s block-wise, computed in float32 (float64 for a float64 result: exact) and rounded once."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    n, k = q.shape[-2:]
    return (q.to(wide) * expand_scale(scale.to(wide), n, k)).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of weights w [..., N, K]: per 128 x 128 block, scale = amax / 448 (1 for an all-zero
    block) and q = w / scale rounded to E4M3, as transformers' FineGrainedFP8 and vLLM quantize."""
    *lead, n, k = w.shape
    rows, cols = scale_shape(tuple(w.shape))[-2:]
    padded = torch.zeros((*lead, rows * BLOCK, cols * BLOCK), dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w.float()
    blocks = padded.unflatten(-1, (cols, BLOCK)).unflatten(-3, (rows, BLOCK))  # [..., R, 128, C, 128]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., R, C]
    # NOTE: a tensor divisor, never the scalar 448: CUDA divides by a scalar as a product with its
    # reciprocal, which rounds differently from the CPU's division (and from every other quantizer)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (padded / expand_scale(scale, rows * BLOCK, cols * BLOCK)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q[..., :n, :k].contiguous(), scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [T, K] float8_e4m3fn, scale [T, ceil(K/128)] float32) of activations x [T, K]: per token and group
    of 128 columns, scale = amax / 448 (1 for an all-zero group) and q = x / scale rounded to E4M3 (ties to
    even), as vLLM's and DeepGEMM's per-token-group quantization for block-FP8 W8A8."""
    t, k = x.shape
    groups = -(-k // BLOCK)
    padded = torch.zeros((t, groups * BLOCK), dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    g = padded.view(t, groups, BLOCK)
    amax = g.abs().amax(dim=-1)  # [T, G]
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(t, -1)
    return q[:, :k].contiguous(), scale


def w8a8_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x [T, K] @ weight^T -> [T, N] as W8A8: x quantized per token and 128 columns (`quantize_activations`),
    each 128-wide K block's float32 product of codes scaled by its activation and weight scales and added in
    ascending block order, rounded once to x's dtype. The reference of ops/triton/fp8_gemm.py (prefill
    chunks on FP8 tensor cores)."""
    xq, xs = quantize_activations(x)
    n, k = weight.q.shape
    ws = weight.scale.repeat_interleave(BLOCK, dim=0)[:n]  # [N, G]
    out = torch.zeros((x.shape[0], n), dtype=torch.float32, device=x.device)
    for b in range(xs.shape[1]):
        cols = slice(b * BLOCK, min(k, (b + 1) * BLOCK))
        part = xq[:, cols].float() @ weight.q[:, cols].float().T  # [T, N], exact products
        out += part * xs[:, b, None] * ws[None, :, b]
    return out.to(x.dtype)


def operand(w: torch.Tensor | Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a plain tensor of `dtype` (FP8 weights dequantized): the reference paths' input."""
    return w.dequantize(dtype) if isinstance(w, Fp8Weight) else w
