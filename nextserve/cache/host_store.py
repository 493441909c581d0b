"""The host image store: prefix images spilled from the device when the device keeps no more, and
brought back (copied into fresh pages) when a prompt resumes from one. Bounded in images and bytes,
least recently used out. Copies are bit for bit, so a restored image resumes exactly as the device
image would have (C1)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .kv_pool import KVPool
from .pinned_arena import ArenaRegion, PinnedArena, region_bytes
from .sequence import SequenceImage, release_image


@dataclass
class HostImage:
    """A SequenceImage's contents in host memory: its state slot copy and its pages' planes. From a CUDA
    pool they are pinned (a region of the pool's host arena when it has room) and a copy stream fills
    them: `ready` is recorded once the copies are."""

    length: int
    state: dict[str, torch.Tensor]
    planes: list[torch.Tensor]  # KVPool.page_planes of the pages: [n_attn, n_pages, ...] each
    ready: torch.cuda.Event | None = None
    region: ArenaRegion | None = None  # NOTE: the tensors are views of it: it lives as long as they
    n_pages: int = field(init=False)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        tensors = [*self.planes, *self.state.values()]
        self.n_pages = self.planes[0].shape[1]
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def _host_tensors(tensors: list[torch.Tensor], arena: PinnedArena | None) -> tuple[list, ArenaRegion | None]:
    """Uninitialised host tensors shaped like `tensors`: in one region of `arena` when there is one with
    (or able to reclaim) room, else fresh (pinned for a CUDA pool: the slow path, a driver call that holds
    up the engine)."""
    shapes = [(t.shape, t.dtype) for t in tensors]
    region = arena.alloc(region_bytes(shapes)) if arena is not None else None
    if region is not None:
        return [region.take(s, d) for s, d in shapes], region
    pin = tensors[0].is_cuda
    return [torch.empty(s, dtype=d, pin_memory=pin) for s, d in shapes], None


def to_host(pool: KVPool, length: int, state: dict[str, torch.Tensor], pages: list[int]) -> HostImage:
    """A host copy of a slot state and of the pages' planes (k, v, block keys; their scales with int8 KV)
    [n_attn, n_pages, ...].

    # NOTE: from a CUDA pool the engine's thread only gathers the pages on the device (its current
    # stream) and queues the copies to host memory on a copy stream, into a region of the pool's pinned
    # host arena (locked once at start: cache/pinned_arena.py). The gathered copies are what is read, so
    # the pool pages may be freed and rewritten at once (later writes run on the current stream, after
    # the gather); each is kept from reuse until the copy stream is past it (record_stream)."""
    idx = torch.tensor(pages, dtype=torch.long, device=pool.device)
    planes = [plane[:, idx] for plane in pool.page_planes()]
    names = list(state)
    tensors = planes + [state[n] for n in names]
    out, region = _host_tensors(tensors, pool.host_arena)
    ready = None
    if pool.device.type != "cuda":
        for host, t in zip(out, tensors, strict=True):
            host.copy_(t)
    else:
        dev = pool.device
        gathered = torch.cuda.Event()
        gathered.record()
        stream = _copy_streams.get(dev) or _copy_streams.setdefault(dev, torch.cuda.Stream(dev))
        with torch.cuda.stream(stream):
            stream.wait_event(gathered)
            for host, t in zip(out, tensors, strict=True):
                host.copy_(t, non_blocking=True)
                t.record_stream(stream)
            ready = torch.cuda.Event()
            ready.record(stream)
        if region is not None:
            region.events.append(ready)
    n = len(planes)
    return HostImage(length, dict(zip(names, out[n:], strict=True)), out[:n], ready, region)


def into_pool(pool: KVPool, pages: list[int], host: HostImage) -> dict[str, torch.Tensor]:
    """Write a host image's planes into the pool's `pages` (bit for bit); its slot state on the pool's
    device. On CUDA the current stream first waits for the image's copy to be complete."""
    dev = pool.device
    if host.ready is not None:
        torch.cuda.current_stream(dev).wait_event(host.ready)
    idx = torch.tensor(pages, dtype=torch.long, device=dev)
    for plane, saved in zip(pool.page_planes(), host.planes, strict=True):
        plane[:, idx] = saved.to(dev, non_blocking=True)
    state = {name: t.to(dev, copy=True, non_blocking=True) for name, t in host.state.items()}
    if host.region is not None and host.ready is not None:  # not handed out again before these reads
        read = torch.cuda.Event()
        read.record()
        host.region.events.append(read)
    return state


def spill(pool: KVPool, image: SequenceImage) -> HostImage:
    """Copy an image to host memory and drop its device page references."""
    host = to_host(pool, image.length, image.state, image.pages)
    release_image(pool, image)
    return host


def unspill(pool: KVPool, host: HostImage, device: torch.device) -> SequenceImage | None:
    """A device image with the host image's contents in freshly taken pages; None (nothing taken)
    when the pool has too few free pages."""
    n = host.n_pages
    if pool.num_free < n:
        return None
    pages = pool.alloc(n)
    return SequenceImage(host.length, into_pool(pool, pages, host), pages)


class HostImageStore:
    """At most `max_images` images and `max_bytes` bytes, keyed like the prefix cache."""

    def __init__(self, max_images: int, max_bytes: int) -> None:
        self.max_images, self.max_bytes = max_images, max_bytes
        self._entries: OrderedDict[bytes, tuple[tuple, HostImage]] = OrderedDict()
        self.nbytes = 0
        self.reserved = 0  # bytes of max_bytes held by others (preempted sequences' copies)

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: bytes, tokens: tuple, image: HostImage) -> None:
        """Keep an image of what `tokens` names (the prefix cache's (salt, token ids))."""
        self.drop(key)
        if image.nbytes > self.max_bytes - self.reserved:
            return
        self._entries[key] = (tokens, image)
        self.nbytes += image.nbytes
        self._fit()

    def reserve(self, nbytes: int) -> None:
        """Leave `nbytes` of the budget to others, dropping least recently used images to fit."""
        self.reserved = nbytes
        self._fit()

    def _fit(self) -> None:
        while self._entries and (
            len(self._entries) > self.max_images or self.nbytes > self.max_bytes - self.reserved
        ):
            self.evict_lru()

    def get(self, key: bytes, tokens: tuple) -> HostImage | None:
        """The image of exactly `tokens` (the tokens are compared: a hash collision never resumes)."""
        entry = self._entries.get(key)
        if entry is None or entry[0] != tokens:
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def evict_lru(self) -> bool:
        """Drop the least recently used image (the host arena's `reclaim`); False when none is left."""
        if not self._entries:
            return False
        _, (_, old) = self._entries.popitem(last=False)
        self.nbytes -= old.nbytes
        return True

    def drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[1].nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
