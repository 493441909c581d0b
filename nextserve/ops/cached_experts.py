"""Routed experts held in host memory with a device cache of some of them: one in-memory form the expert ops
read (ops/moe.py's torch path, ops/triton/moe_grouped.py's kernels), whatever the weights' format.

An expert stack [E, N, K] (`host`: a tensor, an Fp8Weight or an Int4Weight, in pinned host memory on a GPU)
and `cache` [C, N, K] of the same form on the device; `slot[e]` (int32, on the device) is the cache slot
holding expert e, or -1. The kernels read an expert from its slot when it has one, else from host memory
over the bus, so a decode step stays one CUDA graph whatever the cache holds. `counts` (int32, [2, E + 1],
the shared expert last) adds up, since the owner last read it, the (row, expert) pairs routed to each expert
and the calls that read it (runtime/expert_cache.py, which fills and evicts slots between steps).

# NOTE: a slot holds exactly its expert's host values (a copy), and the kernels compute from the values
# they load the same way wherever they load them from, so a cached expert gives the bits of the host one
# (C1): the cache changes where bytes come from, never a result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8 import Fp8Weight
from .int4 import Int4Weight

ExpertWeight = torch.Tensor | Fp8Weight | Int4Weight


@dataclass(frozen=True, eq=False)
class CachedExperts:
    host: ExpertWeight  # [E, N, K]
    cache: ExpertWeight  # [C, N, K], the same form
    slot: torch.Tensor  # [E] int32: expert e's cache slot, -1 when it has none
    counts: torch.Tensor  # [2, E + 1] int32: pairs routed to each expert, and calls reading it

    def __post_init__(self) -> None:
        if type(self.host) is not type(self.cache) and not (
            isinstance(self.host, torch.Tensor) and isinstance(self.cache, torch.Tensor)
        ):
            raise ValueError(f"a cache of {type(self.cache).__name__} for {type(self.host).__name__} experts")
        if tuple(self.cache.shape[1:]) != tuple(self.host.shape[1:]):
            shapes = f"{list(self.cache.shape)} do not hold experts {list(self.host.shape)}"
            raise ValueError(f"cache slots {shapes}")
        if self.slot.shape != (self.host.shape[0],) or self.slot.dtype != torch.int32:
            raise ValueError(f"slot table {list(self.slot.shape)} {self.slot.dtype}: one int32 an expert")

    @property
    def shape(self) -> torch.Size:
        return self.host.shape

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def __getitem__(self, e: int) -> ExpertWeight:
        """Expert e where the kernels would read it (a host read of its slot: the torch path only)."""
        s = int(self.slot[e])
        return self.cache[s] if s >= 0 else self.host[e]

    def count(self, ids: torch.Tensor) -> None:
        """Add a call's routed ids [T, k] (the shared expert's id E included) to `counts`: its pairs, and
        one call for each expert it reads; on the device, without a host read (CUDA-graph capturable)."""
        flat = ids.reshape(-1)
        self.counts[0].index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        read = torch.zeros_like(self.counts[1]).index_fill_(0, flat, 1)
        self.counts[1].add_(read)


def parts(w: ExpertWeight) -> list[torch.Tensor]:
    """The tensors an expert weight is stored in, each [E or C, ...]: what a slot fill copies."""
    if isinstance(w, Fp8Weight):
        return [w.q, w.scale]
    if isinstance(w, Int4Weight):
        return [w.packed, w.scale] + ([] if w.zero is None else [w.zero])
    return [w]


def empty_like_slots(w: ExpertWeight, slots: int, device: torch.device) -> ExpertWeight:
    """A cache of `slots` experts in w's form on `device`, each slot laid out as one of w's experts."""
    new = [torch.empty((slots, *t.shape[1:]), dtype=t.dtype, device=device) for t in parts(w)]
    if isinstance(w, Fp8Weight):
        return Fp8Weight(*new)
    if isinstance(w, Int4Weight):
        return Int4Weight(new[0], new[1], new[2] if len(new) > 2 else None, w.k)
    return new[0]


def expert_bytes(w: ExpertWeight) -> int:
    """The bytes of one expert of w (all its parts)."""
    return sum(t[0].numel() * t.element_size() for t in parts(w))
