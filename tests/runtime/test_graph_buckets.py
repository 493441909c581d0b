"""CUDA-graph buckets and the scratch slot/page that padding rows use (the replay itself is a GPU
test: tests/gpu/test_cuda_graphs.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nextserve.cache.decode_rows import fill_window
from nextserve.cache.kv_pool import KVPool
from nextserve.cache.states import StateSlots
from nextserve.runtime.graph_runner import GraphRunner, bucket_sizes, step_input_buffers, window_sizes


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


def test_window_sizes() -> None:
    assert window_sizes(0) == [1]  # no speculation: decode graphs only
    assert window_sizes(1) == [1, 2]
    assert window_sizes(4) == [1, 2, 3, 5]
    assert window_sizes(6) == [1, 2, 3, 5, 7]
    assert window_sizes(32) == [1, 2, 3, 5, 9, 17, 33]


def _inputs(W: int, *cols: tuple[list[int], ...]) -> np.ndarray:
    """Host inputs [5, W, B] from per-sequence columns (ids, positions, slots, keep, table rows) of W rows."""
    return np.array(
        [[list(r) for r in zip(*(c[f] for c in cols), strict=True)] for f in range(5)], dtype=np.int64
    )


def test_fill_pads_with_the_scratch_slot_and_page(oracle_config) -> None:
    """The static inputs of a replay (built on the CPU here: the buffers are plain tensors)."""
    slots = StateSlots(oracle_config, 4, 2, torch.float32)
    pool = KVPool(oracle_config, 2, 9, 16, torch.float32)
    g = GraphRunner.__new__(GraphRunner)  # no CUDA here: set the buffers up by hand
    g.pool, g.states = pool, slots
    g._uploaded = SimpleNamespace(synchronize=lambda: None, record=lambda: None)  # a CUDA event
    g.inputs, g.meta, g.table = step_input_buffers(4, 5, 3, "cpu", pin=False)
    g.inputs.fill_(255)  # -1 in every field: what the fill does not write shows
    g.inputs_host, meta_host, table_host = step_input_buffers(4, 5, 3, "cpu", pin=False)
    g._meta_np, g._table_np = meta_host.numpy(), table_host.numpy()
    g._fill(_inputs(1, ([11], [40], [2], [4], [0]), ([12], [7], [0], [4], [1])), [[5, 6, 1], [3]], 1, 4)
    assert g.meta.tolist() == [[11, 12, 0, 0], [40, 7, 0, 0], [2, 0, 4, 4], [4, 4, 4, 4], [0, 1, 4, 4]]
    assert g.table.tolist() == [[5, 6, 1], [3, 9, 9], [9, 9, 9], [9, 9, 9], [9, 9, 9]]
    g.inputs.fill_(255)
    g._fill(_inputs(1, ([13], [8], [1], [4], [0])), [[2]], 1, 1)  # a smaller bucket: only its table rows
    stale = [[13, 12, 0, 0], [8, 7, 0, 0], [1, 0, 4, 4], [4, 4, 4, 4], [0, 1, 4, 4]]
    assert g.meta.tolist() == stale  # columns past G: stale, unread
    assert g.table.tolist() == [[2, 9, 9], [9, 9, 9], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1]]
    with pytest.raises(ValueError, match="exceeds"):
        g._fill(_inputs(1, ([1], [1], [1], [4], [0])), [[1, 2, 3, 4]], 1, 1)


def test_fill_lays_windows_out_step_major(oracle_config) -> None:
    """Two windows of 2 rows in a bucket of 3 (meta row j*3 + b), the second's last row padding (-1)."""
    slots = StateSlots(oracle_config, 4, 2, torch.float32, window_steps=1)
    pool = KVPool(oracle_config, 2, 9, 16, torch.float32)
    g = GraphRunner.__new__(GraphRunner)
    g.pool, g.states = pool, slots
    g._uploaded = SimpleNamespace(synchronize=lambda: None, record=lambda: None)  # a CUDA event
    g.inputs, g.meta, g.table = step_input_buffers(6, 4, 2, "cpu", pin=False)
    g.inputs_host, meta_host, table_host = step_input_buffers(6, 4, 2, "cpu", pin=False)
    g._meta_np, g._table_np = meta_host.numpy(), table_host.numpy()
    keep = slots.keep_slot
    a = ([21, 22], [10, 11], [1, 1], [keep(1, 0), 4], [0, 0])
    b = ([31, 0], [5, 0], [3, 4], [4, 4], [1, -1])
    g._fill(_inputs(2, a, b), [[7], [8, 6]], 2, 3)
    assert keep(1, 0) == 6 and slots.gdn_rec.shape[1] == 4 + 1 + 4  # slots, scratch, one keep slot each
    assert g.meta.tolist() == [
        [21, 31, 0, 22, 0, 0],
        [10, 5, 0, 11, 0, 0],
        [1, 3, 4, 1, 4, 4],
        [6, 4, 4, 4, 4, 4],
        [0, 1, 3, 0, 3, 3],  # padding rows read table row 3 (the bucket's size): scratch pages
    ]
    assert g.table.tolist() == [[7, 9], [8, 6], [9, 9], [9, 9]]
    with pytest.raises(IndexError):
        slots.keep_slot(1, 1)


def test_fill_maps_padding_table_rows_in_one_step_windows(oracle_config) -> None:
    """A window of one step (an MTP chain of k = 1, MTP rows of one row each) may hold padding rows in real
    columns too (-1: an item without a chain): they read table row G, never row -1 (a device-side assert
    in index_select on the GPU, which a k = 1 MTP run hit)."""
    meta, table = np.full((5, 4), -7, dtype=np.int64), np.full((4, 2), -7, dtype=np.int32)
    rows = _inputs(1, ([9], [3], [1], [4], [0]), ([0], [0], [4], [4], [-1]))
    fill_window(meta, table, rows, [[5], [6]], 3, 4, 9)
    assert meta.tolist() == [[9, 0, 0, -7], [3, 0, 0, -7], [1, 4, 4, -7], [4, 4, 4, -7], [0, 3, 3, -7]]
    assert table.tolist() == [[5, 9], [6, 9], [9, 9], [9, 9]]
