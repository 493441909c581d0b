"""Writes of one row per decode row into a paged plane (the KV pages, the indexer's block keys).

# On CUDA one Triton launch per call (ops/triton/paged.py) that computes each row's address itself (a launch
# a plane for 8-bit planes, quantizing there); the torch code below (about seven launches: the address's
# division, gather and remainder, then an index_put per plane) is its reference and the CPU path.
"""

import torch

from .kv8 import Kv8Plane
from .triton import use_kernel


def write_paged_rows(
    planes: tuple[torch.Tensor, ...],
    values: tuple[torch.Tensor, ...],
    block_table: torch.Tensor,
    positions: torch.Tensor,
    per_page: int,
    unit: int = 1,
) -> None:
    """For each row b, entry i = positions[b] // unit lives in page block_table[b, i // per_page] at
    i % per_page: plane[page, i % per_page] = value[b] for every (plane, value) pair. Planes are
    [pages, per_page, ...] (contiguous), values [B, ...] of a plane's entry shape; block_table [B, >=]
    int32; positions [B] int64, >= 0. Rows with the same address (padding rows on a scratch page) write
    in an unspecified order."""
    if use_kernel(*planes, *values) and len(planes) <= 2 and all(p.is_contiguous() for p in planes):
        from .triton.paged import triton_write_paged_rows

        return triton_write_paged_rows(planes, values, block_table, positions, per_page, unit)
    if use_kernel(*values) and all(isinstance(p, Kv8Plane) for p in planes):
        from .triton.paged import kv8_writable, triton_write_paged_kv8

        if kv8_writable(planes):
            return triton_write_paged_kv8(planes, values, block_table, positions, per_page, unit)
    entry = torch.div(positions, unit, rounding_mode="floor")
    col = torch.div(entry, per_page, rounding_mode="floor")[:, None]
    page = block_table.gather(1, col)[:, 0].long()
    offset = entry % per_page
    for plane, value in zip(planes, values, strict=True):
        plane.index_put_((page, offset), value)
