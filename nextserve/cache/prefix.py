"""Which sequence images to keep and find: images on the prefill chunk grid, keyed by a hash of the
token prefix they hold, least recently used first out (to the host image store, when there is one)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from .host_store import HostImageStore, spill, unspill
from .kv_pool import KVPool
from .sequence import SequenceImage, release_image


def grid_hashes(tokens: list[int], chunk: int, salt: bytes = b"") -> list[bytes]:
    """hashes[k] names tokens[: (k+1) * chunk] under `salt`; each chains the one before, so a prompt is
    hashed once."""
    out, h = [], hashlib.blake2b(salt, digest_size=16).digest() if salt else b""
    for end in range(chunk, len(tokens) + 1, chunk):
        h = hashlib.blake2b(h + repr(tokens[end - chunk : end]).encode(), digest_size=16).digest()
        out.append(h)
    return out


def image_points(
    prompt_len: int, checkpoints: tuple[int, ...], chunk: int, anchor_chunks: int
) -> frozenset[int]:
    """Grid positions of a prompt to keep prefix images at: its last boundary, the boundary at or before
    each checkpoint, and every `anchor_chunks` chunks (0: none)."""
    # NOTE: also the last boundary strictly inside the prompt, so that the very same prompt sent again
    # (which must recompute at least its last token) resumes too.
    points = {prompt_len // chunk * chunk, (prompt_len - 1) // chunk * chunk}
    points |= {min(p, prompt_len) // chunk * chunk for p in checkpoints}
    if anchor_chunks:
        points |= set(range(chunk * anchor_chunks, prompt_len + 1, chunk * anchor_chunks))
    return frozenset(p for p in points if p > 0)


@dataclass
class _Entry:
    image: SequenceImage
    # NOTE: kept to rule out a hash collision ever resuming the wrong prefix (or another tenant's)
    tokens: tuple[bytes, tuple[int, ...]]  # (salt, tokens)


class PrefixCache:
    """At most `capacity` images. Their pages are shared (refcounted) with the sequences using them."""

    def __init__(self, pool: KVPool, chunk: int, capacity: int, host: HostImageStore | None = None) -> None:
        self.pool, self.chunk, self.capacity, self.host = pool, chunk, capacity, host
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self.host_hits = 0  # lookups served by bringing an image back from the host store
        self.hits = self.misses = 0  # lookups that found an image (device or host), and that found none
        # NOTE: the pipeline's driver has every stage repeat these on its own planes (StageMirror)
        self.spill, self.unspill = spill, unspill

    def __len__(self) -> int:
        return len(self._entries)

    def pages(self) -> set[int]:
        """The pool pages the device images hold (shared with sequences resumed from them)."""
        return {p for entry in self._entries.values() for p in entry.image.pages}

    def lookup(self, prompt: list[int], salt: bytes = b"") -> SequenceImage | None:
        """The longest image under `salt` that is a prefix of prompt and leaves at least one token to
        compute (the last prompt token's logits choose the first output token)."""
        hashes = grid_hashes(prompt, self.chunk, salt)
        for k in range(len(hashes) - 1, -1, -1):
            length = (k + 1) * self.chunk
            if length >= len(prompt):
                continue
            tokens = (salt, tuple(prompt[:length]))
            entry = self._entries.get(hashes[k])
            if entry is not None and entry.tokens == tokens:
                self._entries.move_to_end(hashes[k])
                self.hits += 1
                return entry.image
            if self.host is not None and (host := self.host.get(hashes[k], tokens)) is not None:
                image = self.unspill(self.pool, host, self.pool.device)
                if image is None:
                    continue  # no free pages to bring it back: a shorter image or a cold prefill
                self.host.drop(hashes[k])
                self.host_hits += 1
                self.hits += 1
                self._insert(hashes[k], tokens, image)
                return image
        self.misses += 1
        return None

    def wants(self, tokens: list[int], salt: bytes = b"") -> bool:
        return self.capacity > 0 and grid_hashes(tokens, self.chunk, salt)[-1] not in self._entries

    def insert(self, tokens: list[int], image: SequenceImage, salt: bytes = b"") -> None:
        """Keep an image of exactly `tokens` under `salt` (its length on the grid)."""
        assert image.length == len(tokens) and len(tokens) % self.chunk == 0
        key = grid_hashes(tokens, self.chunk, salt)[-1]
        if key in self._entries:
            release_image(self.pool, image)
            return
        if self.host is not None:
            self.host.drop(key)  # the device image supersedes a spilled one
        self._insert(key, (salt, tuple(tokens)), image)

    def _insert(self, key: bytes, tokens: tuple[bytes, tuple[int, ...]], image: SequenceImage) -> None:
        self._entries[key] = _Entry(image, tokens)
        while len(self._entries) > self.capacity:
            self.evict_one(keep=image, freeing=False)

    def evict_one(self, keep: SequenceImage | None = None, freeing: bool = True) -> bool:
        """Drop the least recently used image (not `keep`; with `freeing`, one whose dropping frees a
        page: no running sequence shares all of its pages) from the device, to the host store when
        there is one (its device pages are released either way); False when there is none to drop."""
        for key, entry in self._entries.items():
            if entry.image is not keep and (
                not freeing or any(self.pool.refcount[p] == 1 for p in entry.image.pages)
            ):
                del self._entries[key]
                if self.host is not None:
                    self.host.put(key, entry.tokens, self.spill(self.pool, entry.image))
                else:
                    release_image(self.pool, entry.image)
                return True
        return False

    def clear(self) -> None:
        """Drop every image, device and host."""
        for entry in self._entries.values():
            release_image(self.pool, entry.image)
        self._entries.clear()
        if self.host is not None:
            self.host.clear()
