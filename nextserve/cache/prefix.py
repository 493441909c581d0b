"""Which sequence images to keep and find: images on the prefill chunk grid, keyed by a hash of the
token prefix they hold, least recently used first out."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from .kv_pool import KVPool
from .sequence import SequenceImage, release_image


def grid_hashes(tokens: list[int], chunk: int) -> list[bytes]:
    """hashes[k] names tokens[: (k+1) * chunk]; each chains the one before, so a prompt is hashed once."""
    out, h = [], b""
    for end in range(chunk, len(tokens) + 1, chunk):
        h = hashlib.blake2b(h + repr(tokens[end - chunk : end]).encode(), digest_size=16).digest()
        out.append(h)
    return out


@dataclass
class _Entry:
    image: SequenceImage
    tokens: tuple[int, ...]  # NOTE: kept to rule out a hash collision ever resuming the wrong prefix


class PrefixCache:
    """At most `capacity` images. Their pages are shared (refcounted) with the sequences using them."""

    def __init__(self, pool: KVPool, chunk: int, capacity: int) -> None:
        self.pool, self.chunk, self.capacity = pool, chunk, capacity
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> SequenceImage | None:
        """The longest image that is a prefix of prompt and leaves at least one token to compute
        (the last prompt token's logits choose the first output token)."""
        hashes = grid_hashes(prompt, self.chunk)
        for k in range(len(hashes) - 1, -1, -1):
            length = (k + 1) * self.chunk
            entry = self._entries.get(hashes[k])
            if length < len(prompt) and entry is not None and entry.tokens == tuple(prompt[:length]):
                self._entries.move_to_end(hashes[k])
                return entry.image
        return None

    def wants(self, tokens: list[int]) -> bool:
        return self.capacity > 0 and grid_hashes(tokens, self.chunk)[-1] not in self._entries

    def insert(self, tokens: list[int], image: SequenceImage) -> None:
        """Keep an image of exactly `tokens` (whose length lies on the grid)."""
        assert image.length == len(tokens) and len(tokens) % self.chunk == 0
        key = grid_hashes(tokens, self.chunk)[-1]
        if key in self._entries:
            release_image(self.pool, image)
            return
        self._entries[key] = _Entry(image, tuple(tokens))
        while len(self._entries) > self.capacity:
            self.evict_one()

    def evict_one(self, keep: SequenceImage | None = None) -> bool:
        """Drop the least recently used image (not `keep`); False when there is none to drop."""
        for key, entry in self._entries.items():
            if entry.image is not keep:
                del self._entries[key]
                release_image(self.pool, entry.image)
                return True
        return False

    def clear(self) -> None:
        while self.evict_one():
            pass
