"""The host image store: prefix images spilled from the device when the device keeps no more, and
brought back (copied into fresh pages) when a prompt resumes from one. Bounded in images and bytes,
least recently used out. Copies are bit for bit, so a restored image resumes exactly as the device
image would have (C1)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .kv_pool import KVPool
from .sequence import SequenceImage, release_image


@dataclass
class HostImage:
    """A SequenceImage's contents in host memory: its state slot copy and its pages' planes."""

    length: int
    state: dict[str, torch.Tensor]
    k: torch.Tensor  # [n_attn, n_pages, P, Nkv, D]
    v: torch.Tensor
    block_keys: torch.Tensor  # [n_attn, n_pages, P // c, di]

    @property
    def nbytes(self) -> int:
        tensors = [self.k, self.v, self.block_keys, *self.state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


def copy_state(state: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """A slot-state copy's tensors copied to `device`."""
    return {name: t.to(device, copy=True) for name, t in state.items()}


def pages_to_host(pool: KVPool, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host copies of the pages' k, v and block-key planes [n_attn, n_pages, ...]."""
    idx = torch.tensor(pages, dtype=torch.long, device=pool.k.device)
    return tuple(plane[:, idx].to("cpu", copy=True) for plane in (pool.k, pool.v, pool.block_keys))


def pages_from_host(
    pool: KVPool, pages: list[int], k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor
) -> None:
    """Write `pages_to_host`'s copies into the pool's `pages` (bit for bit)."""
    idx = torch.tensor(pages, dtype=torch.long, device=pool.k.device)
    for plane, host in ((pool.k, k), (pool.v, v), (pool.block_keys, keys)):
        plane[:, idx] = host.to(plane.device)


def spill(pool: KVPool, image: SequenceImage) -> HostImage:
    """Copy an image to host memory and drop its device page references."""
    host = HostImage(image.length, copy_state(image.state, "cpu"), *pages_to_host(pool, image.pages))
    release_image(pool, image)
    return host


def unspill(pool: KVPool, host: HostImage, device: torch.device) -> SequenceImage | None:
    """A device image with the host image's contents in freshly taken pages; None (nothing taken)
    when the pool has too few free pages."""
    n = host.k.shape[1]
    if pool.num_free < n:
        return None
    pages = pool.alloc(n)
    pages_from_host(pool, pages, host.k, host.v, host.block_keys)
    return SequenceImage(host.length, copy_state(host.state, device), pages)


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
