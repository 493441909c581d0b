"""One page-locked host buffer, locked once at start, that host images (prefix images spilled from the
device, preempted sequences' copies) are carved from and given back to.

# NOTE: locking fresh host memory is a driver call that holds up every launch of the process while it
# runs, from whichever thread makes it (H200: a 25 MiB pinned allocation takes 16.4 ms, and 3000 small
# launches on the main thread took 0.350 s instead of 0.039 s while another thread made them). A store that
# pinned each image as it spilled slowed the prefills beside it by half (BENCHMARKS.md, Prefix reuse and
# agent sessions). Carving a region out of memory locked once costs no driver call.
"""

from __future__ import annotations

import bisect
import math
import weakref
from collections.abc import Callable

import torch

from ..ops.pinned import pinned_empty

ALIGN = 4096  # regions start on host pages; the tensors inside a region on 256-byte boundaries
_TENSOR_ALIGN = 256


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def region_bytes(tensors: list[tuple[torch.Size, torch.dtype]]) -> int:
    """Bytes a region holding tensors of these shapes and dtypes takes."""
    return sum(_round_up(math.prod(s) * d.itemsize, _TENSOR_ALIGN) for s, d in tensors)


class ArenaRegion:
    """A region of the arena. Its tensors are views of the arena: they are valid while the region lives
    (its owner keeps it), and the region goes back to the arena when it is freed, once the CUDA work in
    `events` (the copies that write and read it) has passed."""

    def __init__(self, arena: PinnedArena, offset: int, nbytes: int) -> None:
        self.offset, self.nbytes = offset, nbytes
        self.events: list[torch.cuda.Event] = []
        self._used = 0
        self._buf = arena.buffer
        weakref.finalize(self, arena.release, offset, nbytes, self.events)

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The next tensor of the region (uninitialised)."""
        n = math.prod(shape) * dtype.itemsize
        start = self.offset + self._used
        self._used += _round_up(n, _TENSOR_ALIGN)
        assert self._used <= self.nbytes, "a region holds the tensors it was sized for"
        return self._buf[start : start + n].view(dtype).view(shape)


class PinnedArena:
    """`nbytes` of page-locked host memory, handed out as regions, first fit; freed regions are merged
    with their free neighbours. `reclaim` (set by the owner of what the regions hold: the host image
    store drops its least recently used image) is asked to free something when no free range fits."""

    def __init__(self, nbytes: int, buffer: torch.Tensor | None = None) -> None:
        """`buffer`: uint8 memory of its own instead of freshly locked (tests: plain host memory)."""
        self.nbytes = _round_up(nbytes, ALIGN) if buffer is None else buffer.numel()
        self.buffer = pinned_empty((self.nbytes,), torch.uint8) if buffer is None else buffer  # [nbytes]
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, size), sorted, merged
        self._pending: list[tuple[int, int, list[torch.cuda.Event]]] = []
        self.reclaim: Callable[[], bool] | None = None
        self.used = 0

    def alloc(self, nbytes: int) -> ArenaRegion | None:
        """A region of at least nbytes; None when none fits even after `reclaim` has freed all it can."""
        n = _round_up(max(nbytes, 1), ALIGN)
        if n > self.nbytes:
            return None
        while True:
            self._collect(wait=False)
            at = self._first_fit(n)
            if at is None and self._pending:
                self._collect(wait=True)  # copies still reading freed regions: rare, and short
                at = self._first_fit(n)
            if at is not None:
                return self._take(at, n)
            if self.reclaim is None or not self.reclaim():
                return None

    def release(self, offset: int, nbytes: int, events: list[torch.cuda.Event]) -> None:
        """(A region's finalizer.) The range comes back once every event in `events` has passed."""
        self.used -= nbytes
        self._pending.append((offset, nbytes, events))

    def _collect(self, wait: bool) -> None:
        keep = []
        for offset, nbytes, events in self._pending:
            if wait:
                for e in events:
                    e.synchronize()
            if all(e.query() for e in events):
                self._insert(offset, nbytes)
            else:
                keep.append((offset, nbytes, events))
        self._pending = keep

    def _first_fit(self, n: int) -> int | None:
        return next((i for i, (_, size) in enumerate(self._free) if size >= n), None)

    def _take(self, i: int, n: int) -> ArenaRegion:
        offset, size = self._free[i]
        if size == n:
            del self._free[i]
        else:
            self._free[i] = (offset + n, size - n)
        self.used += n
        return ArenaRegion(self, offset, n)

    def _insert(self, offset: int, nbytes: int) -> None:
        i = bisect.bisect(self._free, (offset, 0))
        if i < len(self._free) and offset + nbytes == self._free[i][0]:  # merge with the next range
            nbytes += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and with the previous
            offset, nbytes = self._free[i - 1][0], self._free[i - 1][1] + nbytes
            self._free[i - 1] = (offset, nbytes)
        else:
            self._free.insert(i, (offset, nbytes))

    @property
    def free_bytes(self) -> int:
        """Bytes free now (pending ranges not counted)."""
        return sum(size for _, size in self._free)
