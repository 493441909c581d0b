"""The pinned host buffers a stage hop reuses (stage_transport.HostTransport): one set for what a stage copies
down and sends, one for what it receives and copies up.

# NOTE: a pinned buffer taken from torch's allocator for each message and dropped after it cost about 13 us
# a hop at each end on an H100's host (the allocator's free lists and the events it records on every block a
# copy used), a third of a one-token hop there (BENCHMARKS.md, Pipeline stages). A buffer here is reused
# once whoever still reads it is done: the channel's send (outgoing), the copy up queued on the GPU
# (incoming); the owner says which through `busy`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MAX_BUFFERS = 4  # kept each way: a stage has at most a few messages in flight (decode groups, logits)
MIN_BYTES = 4096


def capacity(nbytes: int) -> int:
    """The size a buffer for nbytes is made with: the next power of two (at least MIN_BYTES), so that a
    batch that grows by a few rows still fits."""
    return max(MIN_BYTES, 1 << max(0, nbytes - 1).bit_length())


class HopBuffers:
    """Up to `limit` byte buffers (pinned where `pin`), each handed out again once `busy(i)` says its last
    user is done with it."""

    def __init__(self, pin: bool = True, limit: int = MAX_BUFFERS) -> None:
        if limit < 0:
            raise ValueError(f"a hop keeps 0 or more buffers, not {limit}")
        self.pin, self.limit = pin, limit
        self.bufs: list[torch.Tensor] = []  # [capacity] uint8 each

    def take(self, nbytes: int, busy: Callable[[int], bool]) -> tuple[int, torch.Tensor]:
        """(i, the first nbytes of buffer i) for a buffer no one uses any more, made (or grown) when none
        fits; i is -1 for a buffer of this message alone (all `limit` kept ones busy)."""
        spare = -1
        for i, buf in enumerate(self.bufs):
            if busy(i):
                continue
            if buf.numel() >= nbytes:
                return i, buf[:nbytes]
            spare = i if spare < 0 else spare
        new = torch.empty(capacity(nbytes), dtype=torch.uint8, pin_memory=self.pin)
        if len(self.bufs) < self.limit:
            self.bufs.append(new)
            return len(self.bufs) - 1, new[:nbytes]
        if spare >= 0:  # a kept buffer too small for this message: a bigger one in its place
            self.bufs[spare] = new
            return spare, new[:nbytes]
        return -1, new[:nbytes]
