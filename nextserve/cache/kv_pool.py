"""A shared pool of KV pages: the K/V planes of every QSA layer (and the MTP layer) plus the
compressed indexer-key planes, addressed through per-sequence block tables."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..ops.kv8 import CODES, KV_DTYPES, Kv8Plane
from .pinned_arena import PinnedArena


def kv_bytes_per_token(cfg: ModelConfig, n_attn: int, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
    """Bytes a token takes in a pool of `n_attn` attention planes: K and V, and its share of the block key;
    with 8-bit KV (int8, fp8) a byte a value and a float32 scale a vector (ops/kv8.py)."""
    c = cfg.indexer_compress_ratio
    per_layer = 2 * cfg.num_key_value_heads * cfg.head_dim + cfg.indexer_head_dim / c
    if kv_dtype in CODES:
        return int(n_attn * (per_layer + 4 * (2 * cfg.num_key_value_heads + 1 / c))) + 1
    elem = torch.empty((), dtype=dtype).element_size()
    return int(n_attn * per_layer * elem) + 1


class PoolExhausted(RuntimeError):
    """Not enough free pages; the scheduler checks `num_free` first, so this means a bug or a race."""


class KVPool:
    def __init__(
        self,
        cfg: ModelConfig,
        num_attn_layers: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        first_attn: int = 0,
        kv_dtype: str = "auto",
    ) -> None:
        """Planes for attention indices first_attn .. first_attn + num_attn_layers - 1 (a pipeline
        stage keeps only its own layers'; the MTP layer's index is n_qsa). kv_dtype int8 or fp8: the
        planes hold 8-bit codes (as int8 bytes) with a float32 scale plane each (ops/kv8.py), read back in
        `dtype`."""
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        c = cfg.indexer_compress_ratio
        if page_size % c:
            raise ValueError(f"page_size {page_size} must be a multiple of indexer_compress_ratio {c}")
        if num_pages <= 0:
            raise ValueError("the KV pool needs at least one page")
        self.page_size, self.blocks_per_page, self.num_pages = page_size, page_size // c, num_pages
        self.attn = range(first_attn, first_attn + num_attn_layers)
        # NOTE: one page more than the free list holds: the scratch page padded decode rows (graph
        # buckets) write to. No sequence ever owns it, so nothing reads what lands there.
        self.scratch_page = num_pages
        self.dtype, self.quantized, self.kv_dtype = dtype, kv_dtype in CODES, kv_dtype
        store = torch.int8 if self.quantized else dtype
        shape = (num_attn_layers, num_pages + 1, page_size, cfg.num_key_value_heads, cfg.head_dim)
        key_shape = (num_attn_layers, num_pages + 1, self.blocks_per_page, cfg.indexer_head_dim)
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        self.block_keys = torch.zeros(key_shape, dtype=store, device=device)
        # [n_attn, pages + 1, ...] scales of the three planes (8-bit KV), else none
        self.scales = [
            torch.zeros(t.shape[:-1], dtype=torch.float32, device=device)
            for t in ((self.k, self.v, self.block_keys) if self.quantized else ())
        ]
        # NOTE: refcount 0 <=> the page is on the free list. Shared pages (images, prefixes) have
        # refcount > 1 and are copied before a write (copy-on-write).
        self.refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        # where host copies of these pages go (cache/host_store.py); set by the engine on a CUDA pool
        self.host_arena: PinnedArena | None = None

    def planes(self, attn_index: int) -> tuple:
        """(K, V, compressed indexer keys) of one attention layer (model-wide index), every page: tensors,
        or with 8-bit KV each a Kv8Plane (codes and scales, read in the model dtype)."""
        if attn_index not in self.attn:
            raise IndexError(f"attention index {attn_index} is not held here (this pool holds {self.attn})")
        i = attn_index - self.attn.start
        planes = (self.k[i], self.v[i], self.block_keys[i])
        if not self.quantized:
            return planes
        codes = CODES[self.kv_dtype]
        return tuple(
            Kv8Plane(t.view(codes), s[i], self.dtype) for t, s in zip(planes, self.scales, strict=True)
        )

    def page_planes(self) -> list[torch.Tensor]:
        """Every tensor indexed [n_attn, page, ...]: what a page copy or a host image of pages copies."""
        return [self.k, self.v, self.block_keys, *self.scales]

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every plane (what a host copy of it takes)."""
        return sum(t[:, 0].numel() * t.element_size() for t in self.page_planes())

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcount[p] > 0, f"incref of free page {p}"
            self.refcount[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcount[p] > 0, f"double free of page {p}"
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)

    def copy_page(self, src: int, dst: int) -> None:
        for t in self.page_planes():
            t[:, dst] = t[:, src]
