"""CUDA graphs of the decode step (embedding -> layers -> mixer -> lm_head), one per batch-size bucket.

A decode step launches thousands of small kernels; replaying it as one graph removes the launch and
Python cost. The step reads every per-step input (token ids, positions, state slots, block tables)
from static device buffers, which `replay` fills before each replay.
"""

from __future__ import annotations

import logging

import torch

from ..cache.decode_rows import DecodeRows, fill_block_tables
from ..cache.kv_pool import KVPool
from ..cache.states import StateSlots
from ..model.batch import DecodeBatch
from ..model.flash_next import FlashNext

log = logging.getLogger("nextserve.graphs")


def step_input_buffers(
    rows: int, max_pages: int, device: torch.device | str, pin: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bytes, meta [3, rows] int64: ids, positions, slots, table [rows, max_pages] int32), meta and table
    being views of the one byte buffer: a replay's inputs go to the device in one copy."""
    meta_bytes = 3 * rows * 8
    raw = torch.zeros(meta_bytes + rows * max_pages * 4, dtype=torch.uint8, device=device)
    if pin:
        raw = raw.pin_memory()
    meta = raw[:meta_bytes].view(torch.int64).view(3, rows)
    return raw, meta, raw[meta_bytes:].view(torch.int32).view(rows, max_pages)


def bucket_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_rows (and max_rows itself)."""
    sizes = [b for b in (1, 2, 4) if b < max_rows] + list(range(8, max_rows, 8))
    return sizes + [max_rows]


class GraphRunner:
    # NOTE: padding rows (a batch of 5 replays the graph of 8) use the scratch state slot and the
    # scratch KV page, which no sequence owns; every decode op is row-invariant, so a real row's bits
    # are the same in any bucket, alone, or eager (C1; tests/gpu/test_cuda_graphs.py).
    def __init__(
        self, model: FlashNext, pool: KVPool, states: StateSlots, max_pages: int, max_rows: int
    ) -> None:
        self.model, self.pool, self.states = model, pool, states
        self.buckets = bucket_sizes(max_rows)
        G = self.buckets[-1]
        dev = pool.k.device
        self.inputs, self.meta, self.table = step_input_buffers(G, max_pages, dev, pin=False)
        self.inputs_host, meta_host, table_host = step_input_buffers(G, max_pages, "cpu", pin=True)
        # NOTE: filled through numpy views of the pinned buffers (see fill_block_tables).
        self._meta_np, self._table_np = meta_host.numpy(), table_host.numpy()
        # bucket -> (graph, logits [G, V], their argmax [G]: greedy rows read only this)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    def fits(self, rows: int) -> bool:
        return rows <= self.buckets[-1]

    def _batch(self, B: int) -> DecodeBatch:
        ids, pos, slots = self.meta[0, :B], self.meta[1, :B], self.meta[2, :B]
        return DecodeBatch(ids, pos, DecodeRows(self.pool, self.states, slots, pos, self.table[:B]))

    def _step(self, B: int) -> torch.Tensor:
        return self.model.logits(self.model.decode(self._batch(B)), row_invariant=True)

    def _fill(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]], G: int):
        B = len(ids)
        m, t = self._meta_np, self._table_np
        m[0, :B], m[1, :B], m[2, :B] = ids, positions, slots
        m[:2, B:G], m[2, B:G] = 0, self.states.scratch_slot
        fill_block_tables(t[:G], tables, self.pool.scratch_page)
        # NOTE: one copy: the whole meta (3 x max rows, a few hundred bytes), then the bucket's table rows
        n = self.meta.numel() * 8 + G * self.table.shape[1] * 4
        self.inputs[:n].copy_(self.inputs_host[:n], non_blocking=True)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every bucket up (Triton compiles here), then capture the largest first so the smaller
        graphs reuse its memory pool. Only the scratch slot and page are written."""
        self._fill([], [], [], [], self.buckets[-1])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for B in self.buckets:
                self._step(B)
        torch.cuda.current_stream().wait_stream(side)
        mempool = torch.cuda.graph_pool_handle()
        for B in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                out = self._step(B)
                top = out.argmax(dim=-1)
            self.graphs[B] = (graph, out, top)
        torch.cuda.synchronize()
        log.info("captured decode graphs for batch sizes %s", self.buckets)

    def replay(
        self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, V] of one decode step and their argmax [B] (views of the graph's outputs: copy
        them before the next replay)."""
        B = len(ids)
        G = next(b for b in self.buckets if b >= B)
        self._fill(ids, positions, slots, tables, G)
        graph, out, top = self.graphs[G]
        graph.replay()
        return out[:B], top[:B]
