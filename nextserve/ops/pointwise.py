"""Transcendental pointwise ops (exp, sigmoid, silu, softplus, softmax, cos/sin).

# NOTE: on CPU, torch computes the vectorised body of a tensor with SLEEF and its tail with the
# scalar libm, which round differently, so an element's bits depend on where it falls in the whole
# tensor. In row-invariant mode each row is therefore its own call on its own copy (C1). Plain
# + - * / and sqrt are exact in both paths and need no care. GPU kernels are per element anyway.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .triton import use_kernel


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


def silu_mul(g: torch.Tensor, u: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
    """silu(g) * u for g, u [T, N]: the shared expert's activation (one Triton launch on CUDA)."""
    if use_kernel(g, u) and g.dtype == u.dtype and g.dim() == 2:
        from .triton.gates import triton_silu_mul

        return triton_silu_mul(g, u)
    return rowwise(F.silu, g, row_invariant) * u


def sigmoid_gate(
    x: torch.Tensor, gate: torch.Tensor, add: torch.Tensor | None = None, row_invariant: bool = False
) -> torch.Tensor:
    """[add +] x * sigmoid(gate): x [T, N]; gate [T, N], [T, heads, N / heads] or [T, 1]; add [T, N]
    (one Triton launch on CUDA, a head-split gate read in place)."""
    ts = (x, gate) if add is None else (x, gate, add)
    dims_ok = x.dim() == 2 and gate.dim() in (2, 3) and (add is None or add.dim() == 2)
    if use_kernel(*ts) and dims_ok and all(t.dtype == x.dtype for t in ts):
        from .triton.gates import triton_sigmoid_gate

        return triton_sigmoid_gate(x, gate, add)
    gate = gate.reshape(x.shape[0], -1)
    y = x * rowwise(torch.sigmoid, gate, row_invariant)
    return y if add is None else add + y
