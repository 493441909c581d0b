"""Parameter holders named like the checkpoint, so state-dict keys match transformers' names.

A `Projection` is a weight only ever used through `ops.linear` (or the expert ops, for `Experts`): it may
hold block-wise FP8 values (`fp8_parameters`, which model/loader.materialize calls: then `weight` is
float8_e4m3fn and `weight_scale_inv` its float32 block scales, the checkpoint's names), and its `operand` is
what the ops take. Any other weight (norms,
convolutions, embeddings, the hyper-connections' mixing projections) is always in the model dtype: an FP8
checkpoint's values for it are dequantized when loaded.
"""

import torch
from torch import nn

from ..ops.fp8 import BLOCK, FP8, Fp8Weight, scale_shape
from ..ops.int4 import Int4Weight, packed_width
from ..ops.linear import linear
from ..ops.pinned import pinned_empty

SCALE = "_scale_inv"  # name suffix of an FP8 parameter's scales: `X.weight` -> `X.weight_scale_inv`
INT4_SCALE, INT4_ZERO = "_scale", "_zero"  # an int4 parameter's group scales and (asymmetric) zero points
QUANT_SUFFIXES = (SCALE, INT4_SCALE, INT4_ZERO)


class Weight(nn.Module):
    """A module with one `weight` (a projection matrix or a norm vector); its op is called elsewhere."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape), requires_grad=False)

    @property
    def operand(self) -> torch.Tensor | Fp8Weight:
        """The weight as the ops take it (an Fp8Weight when stored in FP8: Projection only)."""
        return operand_of(self, "weight")


def empty_storage(shape, dtype: torch.dtype, device: torch.device | str, host: bool) -> torch.Tensor:
    """Uninitialised storage on device, or (host, a GPU device) page-locked host memory its kernels read."""
    if host and torch.device(device).type == "cuda":
        return pinned_empty(tuple(shape), dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def fp8_parameters(module: nn.Module, name: str, device: torch.device | str, host: bool = False) -> None:
    """Turn module's parameter `name` into an empty FP8 one on device (pinned host memory with `host`),
    with `{name}_scale_inv` beside it (a loader or a random fill fills both)."""
    p = getattr(module, name)
    setattr(module, name, nn.Parameter(empty_storage(p.shape, FP8, device, host), requires_grad=False))
    scale = empty_storage(scale_shape(tuple(p.shape)), torch.float32, device, host)
    module.register_parameter(name + SCALE, nn.Parameter(scale, requires_grad=False))


def int4_parameters(
    module: nn.Module,
    name: str,
    device: torch.device | str,
    group: int,
    scale_dtype: torch.dtype,
    symmetric: bool,
    host: bool = False,
) -> None:
    """Turn module's parameter `name` [..., N, K] into empty packed int4 words [..., N, K/8] (int32) with
    `{name}_scale` [..., N, K/group] in `scale_dtype` and, asymmetric, `{name}_zero` (int8) beside it
    (ops/int4.py's form; a loader fills them)."""
    p = getattr(module, name)
    *lead, n, k = p.shape
    packed = empty_storage((*lead, n, packed_width(k)), torch.int32, device, host)
    setattr(module, name, nn.Parameter(packed, requires_grad=False))
    scale = empty_storage((*lead, n, k // group), scale_dtype, device, host)
    module.register_parameter(name + INT4_SCALE, nn.Parameter(scale, requires_grad=False))
    if not symmetric:
        zero = empty_storage(scale.shape, torch.int8, device, host)
        module.register_parameter(name + INT4_ZERO, nn.Parameter(zero, requires_grad=False))


def set_operand(module: nn.Module, name: str, operand) -> None:
    """Make `operand` what the ops take for module's parameter `name` (an engine's placement of it, such as
    routed experts with a device cache: ops/cached_experts.py); the parameter itself stays."""
    module.__dict__.setdefault("_operands", {})[name] = operand


def operand_of(module: nn.Module, name: str) -> torch.Tensor | Fp8Weight | Int4Weight:
    placed = module.__dict__.get("_operands", {}).get(name)
    if placed is not None:
        return placed
    p = getattr(module, name)
    if p.dtype == FP8:
        return Fp8Weight(p, getattr(module, name + SCALE))
    if p.dtype == torch.int32:  # (K is a multiple of the group, itself of 8: the words hold it exactly)
        return Int4Weight(
            p, getattr(module, name + INT4_SCALE), getattr(module, name + INT4_ZERO, None), p.shape[-1] * 8
        )
    return p


class Projection(Weight):
    """A projection matrix [N, K], which may be stored in FP8 (the module docstring)."""


def fuse_rows(*holders: Weight, align: int = 1) -> torch.Tensor | Fp8Weight | None:
    """Stack the weights [N_i, K] of projections that read the same input into one [sum N_i, K], each
    holder's weight becoming a view of its rows: one GEMV launch instead of several in a decode step, and
    no second copy of the weights. Returns the stack; None (nothing changed) for FP8 and plain weights
    together. A plain stack ends in zero rows up to a multiple of `align` rows.

    # NOTE: FP8 weights stack with each holder's rows padded to a whole 128-row scale block (zero rows,
    # inside that block's scale), so every holder's scales stay its own: the GDN's 48-row b and a cost 160
    # padding rows of 16,640, and `project` drops the padding columns."""
    ops = [h.operand for h in holders]
    if any(isinstance(w, Int4Weight) for w in ops):
        return _fuse_int4(holders, ops)
    fp8 = [isinstance(w, Fp8Weight) for w in ops]
    if not any(fp8):
        rows = [h.weight.shape[0] for h in holders]
        pad = -sum(rows) % align  # NOTE: zero rows at the end, no holder's (`project` drops them)
        w = holders[0].weight
        fused = torch.cat([h.weight.data for h in holders] + [w.new_zeros((pad, w.shape[1]))])
        _share_rows(holders, fused, "weight", rows)
        return fused
    if not all(fp8):
        return None
    rows = padded_rows(holders)
    q = torch.zeros((sum(rows), holders[0].weight.shape[1]), dtype=FP8, device=holders[0].weight.device)
    start = 0
    for h, n in zip(holders, rows, strict=True):
        q[start : start + h.weight.shape[0]].copy_(h.weight.data)
        start += n
    scale = torch.cat([getattr(h, "weight" + SCALE).data for h in holders])
    _share_rows(holders, q, "weight", rows)
    _share_rows(holders, scale, "weight" + SCALE, [n // BLOCK for n in rows[:-1]] + [-1])
    return Fp8Weight(q, scale)


def _fuse_int4(holders, ops) -> Int4Weight | None:
    """An int4 stack: words, scales (and zero points) of each holder's rows one after the other (packed
    along K, so rows stack as they are); None when not every holder is int4 of one grouping."""
    if not all(isinstance(w, Int4Weight) for w in ops):
        return None
    if len({(w.k, w.group, w.zero is None, w.scale.dtype) for w in ops}) != 1:
        return None
    rows = [h.weight.shape[0] for h in holders]
    parts = {"weight": torch.cat([h.weight.data for h in holders])}
    parts["weight" + INT4_SCALE] = torch.cat([getattr(h, "weight" + INT4_SCALE).data for h in holders])
    if ops[0].zero is not None:
        parts["weight" + INT4_ZERO] = torch.cat([getattr(h, "weight" + INT4_ZERO).data for h in holders])
    for name, fused in parts.items():
        _share_rows(holders, fused, name, rows)
    zero = parts.get("weight" + INT4_ZERO)
    return Int4Weight(parts["weight"], parts["weight" + INT4_SCALE], zero, ops[0].k)


def padded_rows(holders) -> list[int]:
    """Each holder's rows in an FP8 stack: all but the last rounded up to whole 128-row blocks."""
    ns = [h.weight.shape[0] for h in holders]
    return [-(-n // BLOCK) * BLOCK for n in ns[:-1]] + ns[-1:]


def _share_rows(holders, fused: torch.Tensor, name: str, strides: list[int]) -> None:
    """Each holder's `name` becomes a view of its rows of `fused` (holder i's start after strides[:i];
    its own length as before: padding rows are no holder's)."""
    start = 0
    for h, step in zip(holders, strides, strict=True):
        p = getattr(h, name)
        n = p.shape[0]
        p.data = fused[start : start + n]
        start += step


def project(
    x: torch.Tensor, holders: tuple[Weight, ...], stacked: torch.Tensor | Fp8Weight | None, ri: bool
) -> tuple[torch.Tensor, ...]:
    """x through each holder's projection: one GEMV over their `fuse_rows` stack when there is one."""
    if isinstance(stacked, Fp8Weight):
        parts = linear(x, stacked, ri).split(padded_rows(holders), dim=-1)
        return tuple(p[:, : h.weight.shape[0]] for p, h in zip(parts, holders, strict=True))
    if isinstance(stacked, Int4Weight):
        return linear(x, stacked, ri).split([h.weight.shape[0] for h in holders], dim=-1)
    if stacked is not None:
        rows = [h.weight.shape[0] for h in holders]
        return linear(x, stacked, ri)[:, : sum(rows)].split(rows, dim=-1)
    return tuple(linear(x, h.operand, ri) for h in holders)
