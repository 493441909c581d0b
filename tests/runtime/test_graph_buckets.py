"""CUDA-graph buckets and the scratch slot/page that padding rows use (the replay itself is a GPU
test: tests/gpu/test_cuda_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from nextserve.cache.kv_pool import KVPool
from nextserve.cache.states import StateSlots
from nextserve.runtime.graph_runner import GraphRunner, bucket_sizes, step_input_buffers


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


def test_fill_pads_with_the_scratch_slot_and_page(oracle_config) -> None:
    """The static inputs of a replay (built on the CPU here: the buffers are plain tensors)."""
    slots = StateSlots(oracle_config, 4, 2, torch.float32)
    pool = KVPool(oracle_config, 2, 9, 16, torch.float32)
    g = GraphRunner.__new__(GraphRunner)  # no CUDA here: set the buffers up by hand
    g.pool, g.states = pool, slots
    g.inputs, g.meta, g.table = step_input_buffers(4, 3, "cpu", pin=False)
    g.inputs.fill_(255)  # -1 in every field: what the fill does not write shows
    g.inputs_host, meta_host, table_host = step_input_buffers(4, 3, "cpu", pin=False)
    g._meta_np, g._table_np = meta_host.numpy(), table_host.numpy()
    g._fill([11, 12], [40, 7], [2, 0], [[5, 6, 1], [3]], G=4)
    assert g.meta.tolist() == [[11, 12, 0, 0], [40, 7, 0, 0], [2, 0, 4, 4]]
    assert g.table.tolist() == [[5, 6, 1], [3, 9, 9], [9, 9, 9], [9, 9, 9]]
    g.inputs.fill_(255)
    g._fill([13], [8], [1], [[2]], G=1)  # a smaller bucket copies the meta and only its table rows
    assert g.meta.tolist() == [[13, 12, 0, 0], [8, 7, 0, 0], [1, 0, 4, 4]]  # columns past G: stale, unread
    assert g.table.tolist() == [[2, 9, 9], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1]]
    with pytest.raises(ValueError, match="exceeds"):
        g._fill([1], [1], [1], [[1, 2, 3, 4]], G=1)
