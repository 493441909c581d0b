"""The host image store: prefix images spilled from the device when the device keeps no more, and
brought back (copied into fresh pages) when a prompt resumes from one. Bounded in images and bytes,
least recently used out. Copies are bit for bit, so a restored image resumes exactly as the device
image would have (C1)."""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .kv_pool import KVPool
from .sequence import SequenceImage, release_image


@dataclass
class HostImage:
    """A SequenceImage's contents in host memory: its state slot copy and its pages' planes. From a CUDA
    pool the copy worker allocates them (pinned) and a copy stream fills them: `job` until the worker is
    done (`complete`), then `ready`, recorded once the copies are."""

    length: int
    state: dict[str, torch.Tensor] | None
    k: torch.Tensor | None  # [n_attn, n_pages, P, Nkv, D]
    v: torch.Tensor | None
    block_keys: torch.Tensor | None  # [n_attn, n_pages, P // c, di]
    ready: torch.cuda.Event | None = None
    job: Future | None = None
    n_pages: int = -1  # (given with a job; else read from k)
    nbytes: int = -1
    state_names: tuple[str, ...] = ()  # the state's keys, in the job's order

    def __post_init__(self) -> None:
        if self.job is None:
            tensors = [self.k, self.v, self.block_keys, *self.state.values()]
            self.n_pages = self.k.shape[1]
            self.nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def complete(self) -> HostImage:
        """The image with its tensors (waiting for the copy worker, not for the copies)."""
        if self.job is not None:
            (self.k, self.v, self.block_keys, *rest), self.ready = self.job.result()
            self.state, self.job = dict(zip(self.state_names, rest, strict=True)), None
        return self


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}
_copy_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nextserve-host-copy")


def _copy_out(
    tensors: list[torch.Tensor], gathered: torch.cuda.Event
) -> tuple[list[torch.Tensor], torch.cuda.Event]:
    """(On the copy worker.) Pinned host copies of `tensors` once `gathered` has passed, on the device's
    copy stream, and the event recorded after them."""
    dev = tensors[0].device
    with torch.cuda.device(dev):
        stream = _copy_streams.get(dev) or _copy_streams.setdefault(dev, torch.cuda.Stream(dev))
        out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        with torch.cuda.stream(stream):
            stream.wait_event(gathered)
            for host, t in zip(out, tensors, strict=True):
                host.copy_(t, non_blocking=True)
                t.record_stream(stream)
            ready = torch.cuda.Event()
            ready.record(stream)
    return out, ready


def to_host(pool: KVPool, length: int, state: dict[str, torch.Tensor], pages: list[int]) -> HostImage:
    """A host copy of a slot state and of the pages' k, v and block-key planes [n_attn, n_pages, ...].

    # NOTE: from a CUDA pool the engine's thread only gathers the pages on the device (its current
    # stream) and hands the rest to the copy worker: pinning fresh host memory costs about as much as the
    # copy itself (session 14 measured a preemption's 412 MB at 0.216 s, all of it on the engine's
    # thread), and the copy then runs on a copy stream. The gathered copies are what is read, so the pool
    # pages may be freed and rewritten at once (later writes run on the current stream, after the
    # gather); each is kept from reuse until the copy stream is past it (record_stream)."""
    idx = torch.tensor(pages, dtype=torch.long, device=pool.k.device)
    planes = [plane[:, idx] for plane in (pool.k, pool.v, pool.block_keys)]
    names = list(state)
    tensors = planes + [state[n] for n in names]
    if not pool.k.is_cuda:
        copies = [t.to("cpu", copy=True) for t in tensors]
        return HostImage(length, dict(zip(names, copies[3:], strict=True)), *copies[:3])
    gathered = torch.cuda.Event()
    gathered.record()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    job = _copy_worker.submit(_copy_out, tensors, gathered)
    return HostImage(length, None, None, None, None, None, job, len(pages), nbytes, tuple(names))


def into_pool(pool: KVPool, pages: list[int], host: HostImage) -> dict[str, torch.Tensor]:
    """Write a host image's planes into the pool's `pages` (bit for bit); its slot state on the pool's
    device. On CUDA the current stream first waits for the image's copy to be complete."""
    dev = pool.k.device
    host.complete()
    if host.ready is not None:
        torch.cuda.current_stream(dev).wait_event(host.ready)
    idx = torch.tensor(pages, dtype=torch.long, device=dev)
    for plane, planes in ((pool.k, host.k), (pool.v, host.v), (pool.block_keys, host.block_keys)):
        plane[:, idx] = planes.to(dev, non_blocking=True)
    return {name: t.to(dev, copy=True, non_blocking=True) for name, t in host.state.items()}


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
            _, (_, old) = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes

    def get(self, key: bytes, tokens: tuple) -> HostImage | None:
        """The image of exactly `tokens` (the tokens are compared: a hash collision never resumes)."""
        entry = self._entries.get(key)
        if entry is None or entry[0] != tokens:
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[1].nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
