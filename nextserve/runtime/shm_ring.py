"""A one-writer, one-reader ring of fixed-size slots in a shared-memory file (/dev/shm), the same-host hop of
`--stage-transport shm` (runtime/shm_channel.py): a message is copied into as many slots as it needs and
read out of them in order; nothing on the path is a socket or a system call.

Layout: the writer's count of slots written (an int64 at byte 0), the reader's count of slots read (at byte
64, its own cache line), then `slots` slots of a 64-byte header (the bytes the slot holds) and `slot_bytes`
of payload. Each side only ever stores its own count.

# NOTE: a slot is published by storing the writer's count after its payload and header, and freed by storing
# the reader's count after its payload was copied out. That order is what the other process sees on x86-64
# (stores become visible in program order, and loads are not reordered with loads: TSO), which is why
# `--stage-transport shm` is refused on other machines (engine_config.py). The counts are aligned int64
# stores and loads (numpy scalar assignment), never torn.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np
import torch

HEADER = 64  # bytes before a slot's payload (its byte count)
COUNTS = 128  # the two counts, a cache line each
WRITTEN, READ = 0, 8  # int64 indices of the counts


def ring_bytes(slots: int, slot_bytes: int) -> int:
    return COUNTS + slots * (HEADER + slot_bytes)


class ShmRing:
    """One direction of traffic between two processes (module docstring). `create` makes the file (zeroed);
    the other side opens it by path; either may unlink the path once both have mapped it (the memory lives
    on until both unmap it)."""

    def __init__(self, path: str | Path, slots: int, slot_bytes: int, create: bool) -> None:
        if slots < 1 or slot_bytes < 1 or slot_bytes % 64:
            raise ValueError(
                f"a ring needs slots >= 1 and slot_bytes a positive multiple of 64: {slots}, {slot_bytes}"
            )
        self.path, self.slots, self.slot_bytes = str(path), slots, slot_bytes
        size = ring_bytes(slots, slot_bytes)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"{self.path} is {os.fstat(fd).st_size} bytes, not a ring of {size}")
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)  # [size] the whole file, shared
        self.counts = np.frombuffer(self.map, dtype=np.int64, count=COUNTS // 8)
        stride = HEADER + slot_bytes
        self.sizes = np.ndarray((slots,), dtype=np.int64, buffer=self.map, offset=COUNTS, strides=(stride,))
        self.written = int(self.counts[WRITTEN])  # this side's copy of its own count
        self.read = int(self.counts[READ])
        # NOTE: a copy is one memmove between addresses: a hop's bytes are few, and torch's slicing and
        # copy_ around them cost more than the copy itself (BENCHMARKS.md, Pipeline stages)
        base = self.bytes.data_ptr() + COUNTS + HEADER
        self.payloads = [base + i * stride for i in range(slots)]  # each slot's payload address

    # ---- the writer's side ---------------------------------------------------------------------------------
    def free_slots(self) -> int:
        return self.slots - (self.written - int(self.counts[READ]))

    def put_chunk(self, src: int, n: int) -> None:
        """Copy n bytes (at most slot_bytes) from address src into the next slot and publish it; the caller
        checked that a slot is free (`free_slots`) and keeps src alive."""
        assert 0 < n <= self.slot_bytes, (n, self.slot_bytes)
        slot = self.written % self.slots
        ctypes.memmove(self.payloads[slot], src, n)
        self.sizes[slot] = n
        self.written += 1
        self.counts[WRITTEN] = self.written  # NOTE: last: publishes the slot (module NOTE)

    # ---- the reader's side ---------------------------------------------------------------------------------
    def ready_slots(self) -> int:
        return int(self.counts[WRITTEN]) - self.read

    def get_chunk(self, dst: int, room: int) -> int:
        """Copy the next slot's bytes to address dst (room bytes there) and free the slot; returns how many.
        The caller checked that a slot is ready (`ready_slots`)."""
        slot = self.read % self.slots
        n = int(self.sizes[slot])
        if not 0 < n <= min(self.slot_bytes, room):
            raise RuntimeError(f"shared-memory ring {self.path}: a slot of {n} bytes where {room} are due")
        ctypes.memmove(dst, self.payloads[slot], n)
        self.read += 1
        self.counts[READ] = self.read  # NOTE: last: the slot may be written again (module NOTE)
        return n

    def close(self) -> None:
        del self.bytes, self.counts, self.sizes
        try:
            self.map.close()
        except BufferError:  # a tensor view still alive: the mapping goes with the process
            pass
