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
from ..ops.tokens import greedy_ids
from .mtp_runner import MtpDrafter

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
        drafter: MtpDrafter | None = None,
        logits: bool = True,
        tokens: torch.Tensor | None = None,
    ) -> None:
        """`drafter`: also capture its window graphs (MTP rows of committed window rows and the chains
        after them, per (rows per sequence, bucket)). A pipeline stage's model (not the first) reads the
        previous stage's streams from a static buffer that `replay` fills; `logits` False: the graphs end
        with the streams (a stage's, whose driver samples). `tokens` [>= max_rows * (1 + max_drafts)]
        int64: where every graph writes its rows' argmax, and whose entries ids of -(1 + r) name (a step
        launched before the host read the previous one's tokens: ModelRunner.launch_decode)."""
        self.model, self.pool, self.states, self.drafter = model, pool, states, drafter
        self.logits = logits and model.is_last
        assert tokens is not None or not self.logits, "graphs that end in logits write their argmax to tokens"
        self.tokens = tokens
        self.buckets = bucket_sizes(max_rows)
        self.windows = window_sizes(max_drafts)
        # the drafter's MTP rows per sequence: up to 1 + its chain (a window's committed rows; with pipeline
        # windows a held pair's, whose chain is 2k + 1: runtime/pipeline_windows.py)
        self.mtp_windows = window_sizes(drafter.k) if drafter is not None else [1]
        G = self.buckets[-1]
        # NOTE: meta columns: the windows' rows (up to W*G), then the drafter's chain steps (k*G)
        self.cols = G * max(self.windows[-1], self.mtp_windows[-1])
        cols = self.cols + (G * drafter.k if drafter is not None else 0)
        dev = pool.device
        self.inputs, self.meta, self.table = step_input_buffers(cols, G + 1, max_pages, dev, pin=False)
        self.inputs_host, meta_host, table_host = step_input_buffers(cols, G + 1, max_pages, "cpu", pin=True)
        # NOTE: filled through numpy views of the pinned buffers (see fill_block_tables).
        self._meta_np, self._table_np = meta_host.numpy(), table_host.numpy()
        # (W, bucket) -> (graph, streams [W*G, nH], logits [W*G, V], their argmax [W*G])
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, ...]] = {}
        # (Wm, bucket) -> (graph, drafts [k, G]): the drafter's MTP rows and chains
        self.mtp_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # NOTE: the pinned inputs are refilled only once the last upload of them has run: a pipeline
        # stage's host does not wait for its GPU between steps (one process does, for the tokens).
        self._uploaded = torch.cuda.Event()
        nH = model.cfg.hc_hidden
        self.x_in = None if model.is_first else torch.zeros(self.cols, nH, dtype=pool.dtype, device=dev)
        if drafter is not None:  # the MTP rows' input streams and the chains' first
            dtype = drafter.states.mtp_hidden.dtype
            self.mtp_x = torch.zeros(self.cols, nH, dtype=dtype, device=dev)
            self.mtp_multi = torch.zeros(G, nH, dtype=dtype, device=dev)

    def fits(self, rows: int, W: int = 1) -> bool:
        """Whether a step of `rows` sequences, W rows each, has a graph."""
        return rows <= self.buckets[-1] and W <= self.windows[-1]

    def _fill(self, inputs: np.ndarray, tables: list[list[int]], W: int, G: int) -> None:
        self._uploaded.synchronize()
        scratch_slot, scratch_page = self.states.scratch_slot, self.pool.scratch_page
        fill_window(self._meta_np, self._table_np, inputs, tables, G, scratch_slot, scratch_page, W)
        self._upload(G)

    def _upload(self, G: int) -> None:
        # NOTE: one copy: the whole meta (5 x its columns, a few KB), then the bucket's table rows
        n = self.meta.numel() * 8 + (G + 1) * self.table.shape[1] * 4
        self.inputs[:n].copy_(self.inputs_host[:n], non_blocking=True)
        self._uploaded.record()

    def _bucket(self, W_in: int, B: int, windows: list[int] | None = None) -> tuple[int, int]:
        """The captured (W, bucket) a step of W_in rows for B sequences replays (its extra rows padding),
        among `windows` (default: the target's window lengths)."""
        windows = windows or self.windows
        return next(w for w in windows if w >= W_in), next(b for b in self.buckets if b >= B)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every shape up (Triton compiles here), then capture the largest first so the smaller
        graphs reuse its memory pool. Only the scratch slot and pages are written."""
        G, W = self.buckets[-1], self.cols // self.buckets[-1]
        empty = np.zeros((WINDOW_FIELDS, W, 0), dtype=np.int64)
        self._fill(empty, [], W, G)
        families = [(self.graphs, self._step, self.windows)]
        if self.drafter is not None:
            self._fill_mtp(empty, np.zeros((WINDOW_FIELDS, self.drafter.k, 0), dtype=np.int64), [], W, G)
            families.append((self.mtp_graphs, self._mtp_step, self.mtp_windows))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _, step, windows in families:
                for W in windows:
                    for G in self.buckets:
                        step(W, G)
        torch.cuda.current_stream().wait_stream(side)
        mempool = torch.cuda.graph_pool_handle()
        for graphs, step, windows in families:
            shapes = [(W, G) for W in windows for G in self.buckets]
            for W, G in sorted(shapes, key=lambda s: s[0] * s[1], reverse=True):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool):
                    out = step(W, G)
                graphs[(W, G)] = (graph, *out)
        torch.cuda.synchronize()
        log.info(
            "captured graphs for windows %s x batch sizes %s%s",
            self.windows, self.buckets, " (and the MTP drafter's)" if self.drafter is not None else "",
        )  # fmt: skip

    def _step(self, W: int, G: int) -> tuple[torch.Tensor, ...]:
        """(streams [W*G, nH], logits [W*G, V], argmax [W*G]) of W steps of G rows (streams only without
        logits)."""
        batch = window_batch(self.pool, self.states, self.meta, self.table, W, G, pending=self.tokens)
        streams = self.model.window(batch, None if self.x_in is None else self.x_in[: W * G])
        if not self.logits:
            return (streams,)
        logits = self.model.logits(streams, row_invariant=True)
        return streams, logits, greedy_ids(logits, self.tokens[: W * G])

    def replay(
        self, inputs: np.ndarray, tables: list[list[int]], x: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """W steps of B rows (inputs [5, W, B], see fill_window; x [W*B, nH]: the previous stage's streams,
        for a stage that is not the first): streams [W, B, nH], logits [W, B, V] and their argmax [W, B]
        (None without logits), views of the graph's outputs: copy them before the next replay."""
        _, W_in, B = inputs.shape
        W, G = self._bucket(W_in, B)
        self._fill(inputs, tables, W, G)
        if self.x_in is not None:
            self.x_in[: W * G].view(W, G, -1)[:W_in, :B].copy_(x.view(W_in, B, -1))
        graph, streams, *out = self.graphs[(W, G)]
        graph.replay()
        streams = streams.view(W, G, -1)[:W_in, :B]
        if not out:
            return streams, None, None
        logits, top = out
        return streams, logits.view(W, G, -1)[:W_in, :B], top.view(W, G)[:W_in, :B]

    # ---- the MTP drafter's windows (runtime/mtp_runner.py) ----------------------------------------------
    def fits_mtp(self, rows: int, Wm: int) -> bool:
        return bool(self.mtp_graphs) and rows <= self.buckets[-1] and Wm <= self.mtp_windows[-1]

    def _mtp_step(self, Wm: int, G: int) -> tuple[torch.Tensor]:
        d = self.drafter
        rows = d.window_batch(self.meta, self.table, Wm, G)
        chain = d.window_batch(self.meta[:, self.cols :], self.table, d.k, G)
        return (d.window_drafts(rows, self.mtp_x[: Wm * G], chain, self.mtp_multi[:G]),)

    def _fill_mtp(
        self, rows: np.ndarray, chain: np.ndarray, tables: list[list[int]], Wm: int, G: int
    ) -> None:
        self._uploaded.synchronize()
        scratch_slot, scratch_page = self.states.scratch_slot, self.pool.scratch_page
        fill_window(self._meta_np, self._table_np, rows, tables, G, scratch_slot, scratch_page, Wm)
        fill_window(self._meta_np[:, self.cols :], None, chain, tables, G, scratch_slot, scratch_page)
        self._upload(G)

    def replay_mtp(
        self,
        rows: np.ndarray,
        chain: np.ndarray,
        tables: list[list[int]],
        x_in: torch.Tensor,
        multi0: torch.Tensor,
    ) -> torch.Tensor:
        """The drafter's window_drafts for MTP rows [5, Wm, B] with input streams x_in [Wm, B, nH] and
        chains [5, k, B] from multi0 [B, nH] (MtpDrafter.window_inputs): drafts [k, B], a view of the
        graph's output."""
        _, Wm_in, B = rows.shape
        Wm, G = self._bucket(Wm_in, B, self.mtp_windows)
        self._fill_mtp(rows, chain, tables, Wm, G)
        self.mtp_x[: Wm * G].view(Wm, G, -1)[:Wm_in, :B].copy_(x_in)
        self.mtp_multi[:B].copy_(multi0)
        graph, drafts = self.mtp_graphs[(Wm, G)]
        graph.replay()
        return drafts[:, :B]
