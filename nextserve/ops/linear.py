"""Dense projections."""

import torch
import torch.nn.functional as F

from .fp8 import Fp8Weight
from .int4 import Int4Weight
from .triton import use_kernel


def linear(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight | Int4Weight, row_invariant: bool = False
) -> torch.Tensor:
    """x [T, K] @ weight[N, K]^T -> [T, N]; `weight` may be block-wise FP8 (ops/fp8.py) or int4 (ops/int4.py).

    # On CUDA (not float64) the row-invariant path is one Triton kernel call (ops/triton/gemv.py), which
    # reads FP8 weights as they are and dequantizes them in registers; this per-row loop is its
    # reference, on the dequantized weights (FP8's reference and CPU path).
    # NOTE: a GEMM may pick its blocking (and so its reduction order) from the row count, and a
    # GEMV its peeling from the input's address alignment. In row-invariant mode every row is its
    # own call of one shape on a freshly allocated (so equally aligned) copy, so a row's bits never
    # depend on the rows beside it (C1). Prefill chunks use one call, as the serial reference does
    # (with FP8 weights on CUDA: as W8A8 on FP8 tensor cores, ops/triton/fp8_gemm.py, where the card has
    # them; else on the weights dequantized for the call in one Triton pass, ops/triton/fp8_dequant.py;
    # on the CPU, the dequantized weights).
    # int4 weights likewise: the GEMV reads their words in registers (ops/triton/int4_tiles.py), a prefill
    # chunk runs F.linear on the weight dequantized in one pass (ops/triton/int4_dequant.py), and the
    # reference paths run on the library's values of the weight (ops/int4.py dequantize).
    """
    if row_invariant and use_kernel(x):
        from .triton.gemv import small_m_linear

        return small_m_linear(x, weight)
    if isinstance(weight, Fp8Weight) and use_kernel(x):
        from .triton.fp8_gemm import w8a8_applies, w8a8_linear

        if w8a8_applies(x, weight):
            return w8a8_linear(x, weight)
        from .triton.fp8_dequant import triton_dequantize

        weight = triton_dequantize(weight, x.dtype)
    elif isinstance(weight, Int4Weight) and use_kernel(x):
        from .triton.int4_dequant import triton_dequantize_int4

        weight = triton_dequantize_int4(weight, x.dtype)
    elif isinstance(weight, Fp8Weight | Int4Weight):
        weight = weight.dequantize(x.dtype)
    if not row_invariant:
        return F.linear(x, weight)
    return torch.cat([F.linear(x[i : i + 1].clone(), weight) for i in range(x.shape[0])], dim=0)
