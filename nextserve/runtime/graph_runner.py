"""CUDA graphs of decode steps and verify windows (embedding -> layers -> mixer -> lm_head), one per
(window length W, batch-size bucket): W = 1 is the decode step, W = 1 + d a verify window of d drafts.

A step launches hundreds of small kernels; replaying it as one graph removes the launch and Python cost.
The step reads every per-step input (token ids, positions, state slots, keep slots, block tables) from
static device buffers, which `replay` fills before each replay.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..cache.decode_rows import WINDOW_FIELDS, fill_window, window_batch
from ..cache.kv_pool import KVPool
from ..cache.states import StateSlots
from ..model.flash_next import FlashNext

log = logging.getLogger("nextserve.graphs")


def step_input_buffers(
    rows: int, table_rows: int, max_pages: int, device: torch.device | str, pin: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bytes, meta [5, rows] int64 (ids, positions, slots, keep slots, table rows), table [table_rows,
    max_pages] int32), meta and table being views of the one byte buffer: a replay's inputs go to the
    device in one copy."""
    meta_bytes = WINDOW_FIELDS * rows * 8
    raw = torch.zeros(meta_bytes + table_rows * max_pages * 4, dtype=torch.uint8, device=device)
    if pin:
        raw = raw.pin_memory()
    meta = raw[:meta_bytes].view(torch.int64).view(WINDOW_FIELDS, rows)
    return raw, meta, raw[meta_bytes:].view(torch.int32).view(table_rows, max_pages)


def bucket_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_rows (and max_rows itself)."""
    sizes = [b for b in (1, 2, 4) if b < max_rows] + list(range(8, max_rows, 8))
    return sizes + [max_rows]


def window_sizes(max_drafts: int) -> list[int]:
    """Window lengths with graphs: 1 (decode), 1 + d for d = 1, 2, 4, 8, ... below max_drafts, and
    1 + max_drafts (a window of fewer drafts replays the next length up, its last rows padding)."""
    drafts = [d for d in (1, 2, 4, 8, 16, 32) if d < max_drafts] + ([max_drafts] if max_drafts else [])
    return [1] + [1 + d for d in drafts]


class GraphRunner:
    # NOTE: padding rows (a batch of 5 replays the graph of 8, a window of 2 drafts the graph of 4) use
    # the scratch state slot and scratch KV pages, which no sequence owns; every op is row-invariant, so
    # a real row's bits are the same in any bucket, alone, or eager (C1; tests/gpu/test_cuda_graphs.py).
    def __init__(
        self,
        model: FlashNext,
        pool: KVPool,
        states: StateSlots,
        max_pages: int,
        max_rows: int,
        max_drafts: int = 0,
    ) -> None:
        self.model, self.pool, self.states = model, pool, states
        self.buckets = bucket_sizes(max_rows)
        self.windows = window_sizes(max_drafts)
        G, rows = self.buckets[-1], self.buckets[-1] * self.windows[-1]
        dev = pool.k.device
        self.inputs, self.meta, self.table = step_input_buffers(rows, G + 1, max_pages, dev, pin=False)
        self.inputs_host, meta_host, table_host = step_input_buffers(rows, G + 1, max_pages, "cpu", pin=True)
        # NOTE: filled through numpy views of the pinned buffers (see fill_block_tables).
        self._meta_np, self._table_np = meta_host.numpy(), table_host.numpy()
        # (W, bucket) -> (graph, streams [W*G, nH], logits [W*G, V], their argmax [W*G])
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, ...]] = {}

    def fits(self, rows: int, W: int = 1) -> bool:
        """Whether a step of `rows` sequences, W rows each, has a graph."""
        return rows <= self.buckets[-1] and W <= self.windows[-1]

    def _step(self, W: int, G: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = window_batch(self.pool, self.states, self.meta, self.table, W, G)
        streams = self.model.window(batch)
        return streams, self.model.logits(streams, row_invariant=True)

    def _fill(self, inputs: np.ndarray, tables: list[list[int]], W: int, G: int) -> None:
        fill_window(
            self._meta_np, self._table_np, inputs, tables, G, self.states.scratch_slot, self.pool.scratch_page
        )
        # NOTE: one copy: the whole meta (5 x max rows, a few KB), then the bucket's table rows
        n = self.meta.numel() * 8 + (G + 1) * self.table.shape[1] * 4
        self.inputs[:n].copy_(self.inputs_host[:n], non_blocking=True)

    def _shapes(self) -> list[tuple[int, int]]:
        return [(W, G) for W in self.windows for G in self.buckets]

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every shape up (Triton compiles here), then capture the largest first so the smaller
        graphs reuse its memory pool. Only the scratch slot and pages are written."""
        empty = np.zeros((WINDOW_FIELDS, self.windows[-1], 0), dtype=np.int64)
        self._fill(empty, [], self.windows[-1], self.buckets[-1])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for W, G in self._shapes():
                self._step(W, G)
        torch.cuda.current_stream().wait_stream(side)
        mempool = torch.cuda.graph_pool_handle()
        for W, G in sorted(self._shapes(), key=lambda s: s[0] * s[1], reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                streams, logits = self._step(W, G)
                top = logits.argmax(dim=-1)
            self.graphs[(W, G)] = (graph, streams, logits, top)
        torch.cuda.synchronize()
        log.info("captured graphs for windows %s x batch sizes %s", self.windows, self.buckets)

    def replay(
        self, inputs: np.ndarray, tables: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """W steps of B rows (inputs [5, W, B], see fill_window): streams [W, B, nH], logits [W, B, V] and
        their argmax [W, B], views of the graph's outputs: copy them before the next replay."""
        _, W_in, B = inputs.shape
        W = next(w for w in self.windows if w >= W_in)
        G = next(b for b in self.buckets if b >= B)
        if W > W_in:  # a shorter window: its steps past W_in are padding rows
            pad = np.zeros((WINDOW_FIELDS, W - W_in, B), dtype=np.int64)
            pad[2:4], pad[4] = self.states.scratch_slot, G
            inputs = np.concatenate([inputs, pad], axis=1)
        self._fill(inputs, tables, W, G)
        graph, streams, logits, top = self.graphs[(W, G)]
        graph.replay()
        return (
            streams.view(W, G, -1)[:W_in, :B],
            logits.view(W, G, -1)[:W_in, :B],
            top.view(W, G)[:W_in, :B],
        )
