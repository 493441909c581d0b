"""CUDA-graph buckets and the scratch slot/page that padding rows use (the replay itself is a GPU
test: tests/gpu/test_cuda_graphs.py)."""

from __future__ import annotations

import torch

from nextserve.cache.kv_pool import KVPool
from nextserve.cache.states import StateSlots
from nextserve.runtime.graph_runner import bucket_sizes


def test_bucket_sizes_cover_every_batch() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(16) == [1, 2, 4, 8, 16]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    for top in (1, 3, 8, 33):
        sizes = bucket_sizes(top)
        assert sizes == sorted(set(sizes)) and sizes[-1] == top
        assert all(any(b >= rows for b in sizes) for rows in range(1, top + 1))


def test_scratch_slot_and_page_are_never_handed_out(oracle_config) -> None:
    slots = StateSlots(oracle_config, 3, 2, torch.float32)
    pool = KVPool(oracle_config, 2, 5, 16, torch.float32)
    got_slots = [slots.alloc() for _ in range(3)]
    got_pages = pool.alloc(5)
    assert slots.scratch_slot == 3 and slots.scratch_slot not in got_slots
    assert pool.scratch_page == 5 and pool.scratch_page not in got_pages
    assert slots.gdn_rec.shape[1] == 4 and pool.k.shape[1] == 6  # storage holds the scratch too
    assert slots.num_free == 0 and pool.num_free == 0
