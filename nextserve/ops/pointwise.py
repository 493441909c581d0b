"""Transcendental pointwise ops (exp, sigmoid, silu, softplus, softmax, cos/sin).

# NOTE: on CPU, torch computes the vectorised body of a tensor with SLEEF and its tail with the
# scalar libm, which round differently, so an element's bits depend on where it falls in the whole
# tensor. In row-invariant mode each row is therefore its own call on its own copy (C1). Plain
# + - * / and sqrt are exact in both paths and need no care. GPU kernels are per element anyway.
"""

from collections.abc import Callable

import torch


def rowwise(
    fn: Callable[..., torch.Tensor], x: torch.Tensor, row_invariant: bool, *per_row: torch.Tensor
) -> torch.Tensor:
    """fn(x, *per_row), in row-invariant mode on the CPU one row at a time: fn(x[i] copy, *per_row[i]).
    `per_row` are tensors whose rows go with x's (e.g. each row's position)."""
    if not row_invariant or x.device.type != "cpu":
        return fn(x, *per_row)
    return torch.cat(
        [fn(x[i : i + 1].clone(), *(t[i : i + 1] for t in per_row)) for i in range(x.shape[0])], dim=0
    )
