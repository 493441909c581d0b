"""MTP drafting on one device, the way vLLM runs it (FLASH_NEXT.md section 2).

The MTP layer is a 13th attention layer: attention index n_qsa, with its own K/V and block-key planes in
the shared page pool and its own indexer tail in the state slots. MTP row t reads the target's pre-mixer
streams at t and the embedding of token t+1 and writes the MTP KV at t. After each step the MTP runs its
rows for every target row committed (the draft "prefill"), then chains greedy drafts from each sampling
sequence's last committed row; the next schedule checks them in a verify window (engine/speculative.py),
so whatever they are, outputs do not change (C1).

# NOTE: where the MTP KV at a position comes from, and why it is right when read:
# - row t runs in the step that commits target row t+1, beside it: a chunk (prefill chunk, or a verify
#   window's committed rows) at positions s..e-1 runs MTP rows s-1..e-2 with the chunk's own input
#   tokens, the streams of row s-1 coming from the state slot (StateSlots.mtp_hidden), which then keeps
#   row e-1's. So the MTP rows committed are 0 .. length-2, each made with committed tokens only, in
#   position order, exactly as a cold prefill makes them;
# - the chain writes at length-1 (step 0: the token sampled after the chunk) and on, past what the MTP
#   committed (so row length-1 runs twice, as step 0 and then committed: one MTP row a step). Like the
#   target's rejected rows these are position-addressed (KV, block keys) and rewritten by the committed
#   row of that position before any row at or after it reads them. The indexer tail in the slot is not
#   position-addressed across blocks (row r is "position r of the open block"), so the chain's tail
#   writes are undone;
# - prefix images copy the slot (MTP tail and streams included) and share the pages (MTP planes
#   included); an image at a chunk end e holds MTP rows 0..e-2, which depend only on its prefix, so a
#   resumed prompt runs row e-1 with its own token e and gets the very drafts a cold run gets. That row's
#   page may be shared with the image: the sequence's cache has lag 1 (SequenceCache), so admission's
#   reserve counts and makes a copy of it, and a snapshot splits it off with a free page (else no image);
# - plain decode steps (a grammar request, a sequence's last token, a step after an MTP failure) run no
#   MTP row: that position stays stale, which can only lower acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from ..cache.decode_rows import WINDOW_FIELDS, eager_window, window_batch
from ..cache.kv_pool import KVPool
from ..cache.sequence import SequenceCache
from ..cache.states import StateSlots
from ..config import ModelConfig
from ..model.batch import DecodeBatch, ForwardBatch, SeqChunk, WindowBatch
from ..model.flash_next import FlashNext
from ..model.loader import load_module, meta_device
from ..model.mtp import MTP
from ..model.params import Weight
from ..ops.linear import linear
from ..ops.pinned import upload
from ..ops.ple import lookup_rows


def load_mtp(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "auto",
) -> MTP:
    """The directory's MTP block (only the mtp.* tensors are read), projections fused; a ConfigError
    naming the directory when its checkpoint has none."""
    with meta_device():
        mtp = MTP(cfg)
    load_module(
        mtp, model_dir, cfg, dtype, device, layers=range(0), with_embed=False, with_head=False, with_mtp=True,
        prefix="mtp.", quantization=quantization,
    )  # fmt: skip
    mtp.fuse_projections()
    return mtp.eval()


class _TokenTable(nn.Module):
    """The model's token embeddings alone (what a pipeline's last stage reads for its MTP block)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Weight(cfg.vocab_size, cfg.hidden_size)


def load_head_embedding(
    model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, host: bool
) -> torch.Tensor:
    """The checkpoint's token embeddings [V, H] in dtype: on `device`, or with `host` in pinned host
    memory (on a CUDA device: lookup_rows reads it over the bus; on the CPU it is plain memory)."""
    with meta_device():
        table = _TokenTable(cfg)
    names = frozenset({"embed_tokens.weight"}) if host else frozenset()
    load_module(table, model_dir, cfg, dtype, device, layers=range(0), with_head=False, host=names)
    return table.embed_tokens.weight


@dataclass
class MtpRows:
    """Target rows one sequence committed in this step, as the MTP takes them."""

    cache: SequenceCache
    start: int  # position of the first target row
    streams: torch.Tensor  # [n, nH] the target's pre-mixer streams of the rows
    ids: list[int]  # [n] the rows' input tokens (committed)
    row_invariant: bool  # as the target ran them: verify windows yes, prefill chunks no
    sampled: int | None = None  # the token sampled after the last row, when the chunk sampled one
    chain: int = 0  # drafts to chain from the last row (0: none)

    @property
    def end(self) -> int:
        """The committed end: position of the token after the last row, the next window's start."""
        return self.start + len(self.ids)


class MtpDrafter:
    def __init__(
        self,
        model: FlashNext,
        mtp: MTP,
        states: StateSlots,
        k: int,
        pool: KVPool,
        embed: torch.Tensor | None = None,
    ) -> None:
        """k: drafts per window at most. `embed` [V, H]: the token embeddings the MTP reads (default the
        model's; a pipeline's last stage has its own copy, on its device or pinned in host memory)."""
        if k <= 0:
            raise ValueError(f"MTP drafting needs k >= 1, got {k}")
        self.model, self.mtp, self.states, self.k, self.pool = model, mtp, states, k, pool
        self.embed = model.embed_tokens.weight if embed is None else embed
        self.graphs = None  # a GraphRunner holding this drafter's window graphs (set once captured)

    @torch.inference_mode()
    def run(self, items: list[MtpRows]) -> list[tuple[int, ...]]:
        """Commits the MTP rows of `items` and returns, per item, its greedy chain of `chain` drafts:
        prefill chunks' rows one forward each, verify windows' rows and every chain after them in one
        window of steps (`window_drafts`, a CUDA graph replay where one is captured)."""
        drafts: list[tuple[int, ...]] = [()] * len(items)
        for group, run in ((False, self._prefill_items), (True, self._window_items)):
            chosen = [i for i, it in enumerate(items) if it.row_invariant == group]
            if chosen:
                for i, chain in zip(chosen, run([items[i] for i in chosen]), strict=True):
                    drafts[i] = chain
        return drafts

    def _prefill_items(self, items: list[MtpRows]) -> list[tuple[int, ...]]:
        hidden = self.states.mtp_hidden_plane()  # [S, nH]
        for it in items:
            r_start, streams, ids = self._prefill_rows(it, hidden)
            if ids:  # a prefill chunk's rows: one forward, as the target ran it
                self._forward([(it.cache, r_start, streams, ids)], False)
            hidden[it.cache.slot] = it.streams[-1]
        if not any(_chain_of(it) for it in items):
            return [()] * len(items)
        multi0 = torch.stack([it.streams[-1] for it in items])
        chain = eager_window(self.pool, self.states, *self._chain_inputs(items), multi0.device, False, True)
        return _truncated(self.chain_drafts(chain, multi0), items)

    def window_inputs(self, items: list[MtpRows]) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
        """Host inputs (cache.decode_rows.fill_window) of verify windows' MTP rows [5, Wm, B] (row i of
        item b: position start - 1 + i, fed its committed token i) and of their chains [5, k, B]
        (`_chain_inputs`), and the items' block tables."""
        B, scratch = len(items), self.states.scratch_slot
        rows = np.zeros((WINDOW_FIELDS, max(len(it.ids) for it in items), B), dtype=np.int64)
        rows[2:4], rows[4] = scratch, -1
        for b, it in enumerate(items):
            m, slot = len(it.ids), it.cache.slot
            rows[0, :m, b], rows[1, :m, b] = it.ids, range(it.start - 1, it.start - 1 + m)
            rows[2, :m, b], rows[4, :m, b] = slot, b
        chain, tables = self._chain_inputs(items)
        return rows, chain, tables

    def _chain_inputs(self, items: list[MtpRows]) -> tuple[np.ndarray, list[list[int]]]:
        """Host inputs [5, k, B] of the items' greedy chains (step j at end - 1 + j, step 0 fed the sampled
        token; steps past an item's chain are padding), and the items' block tables."""
        chain = np.zeros((WINDOW_FIELDS, self.k, len(items)), dtype=np.int64)
        chain[2:4], chain[4] = self.states.scratch_slot, -1
        for b, it in enumerate(items):
            n, slot = _chain_of(it), it.cache.slot
            for p in range(it.end - 1, it.end - 1 + n):
                it.cache.own_page_at(p)  # inside what admission reserved: p <= end + chain - 2
            if n:
                chain[0, 0, b], chain[1, :n, b] = it.sampled, range(it.end - 1, it.end - 1 + n)
                chain[2, :n, b], chain[4, :n, b] = slot, b
        return chain, [it.cache.block_table for it in items]

    def _window_items(self, items: list[MtpRows]) -> list[tuple[int, ...]]:
        """Verify windows' committed MTP rows and chains in one window of steps (see window_drafts)."""
        hidden = self.states.mtp_hidden_plane()  # [S, nH]
        rows, chain, tables = self.window_inputs(items)
        slots = upload([it.cache.slot for it in items], torch.long, hidden.device)
        # the rows' input streams [Wm, B, nH]: row i's target streams at start - 1 + i (the slot's, then
        # the window's committed rows but the last); the chains start from the last row's streams
        x = [hidden.index_select(0, slots)[None]]
        if rows.shape[1] > 1:
            x.append(pad_sequence([it.streams[:-1] for it in items]))
        x_in, multi0 = torch.cat(x), torch.stack([it.streams[-1] for it in items])
        hidden.index_copy_(0, slots, multi0)
        if self.graphs is not None and self.graphs.fits_mtp(len(items), rows.shape[1]):
            out = self.graphs.replay_mtp(rows, chain, tables, x_in, multi0)
        else:
            out = self._eager_window(rows, chain, tables, x_in, multi0)
        return _truncated(out, items)

    def _eager_window(self, rows, chain, tables, x_in, multi0) -> torch.Tensor:
        row_batch = eager_window(self.pool, self.states, rows, tables, multi0.device, False, True)
        chain_batch = eager_window(self.pool, self.states, chain, tables, multi0.device, False, True)
        return self.window_drafts(row_batch, x_in.flatten(0, 1), chain_batch, multi0)

    def window_batch(self, meta: torch.Tensor, table: torch.Tensor, W: int, B: int) -> WindowBatch:
        """MTP rows or a chain over device inputs: every step's table gathered (padding rows sit in real
        columns), no state kept (the MTP's rows are committed or undone here)."""
        return window_batch(self.pool, self.states, meta, table, W, B, keep=False, gather=True)

    def window_drafts(
        self, rows: WindowBatch, x_in: torch.Tensor, chain: WindowBatch, multi0: torch.Tensor
    ) -> torch.Tensor:
        """The MTP rows `rows` (x_in [Wm*B, nH] the target's streams at each row's position) committed,
        then k greedy chain steps from multi0 [B, nH], step 0 fed chain's step-0 tokens, each later step
        the draft before: drafts [k, B]. No host reads: one CUDA graph per (Wm, bucket).

        # NOTE: the same rows and steps as the eager MtpDrafter path: each MTP row a decode row at its
        # position (row-invariant), so the drafts do not depend on the batch or on the graph."""
        embed = lookup_rows(self.embed, rows.input_ids)  # [Wm*B, H]
        self.mtp.window(x_in, embed, rows, self.model.rope(rows.positions, x_in.dtype, True))
        return self.chain_drafts(chain, multi0)

    def chain_drafts(self, chain: WindowBatch, multi0: torch.Tensor) -> torch.Tensor:
        """k greedy chain steps from multi0 [B, nH] (the target's streams of each item's last committed
        row), step 0 fed chain's step-0 tokens (the sampled ones), each later step the draft before; each
        step one row-invariant decode row per item at end - 1 + j: drafts [k, B]. No host reads."""
        dtype = multi0.dtype
        first = chain.steps[0].cache.slots  # each row's slot (scratch where it has no chain)
        tail = self.states.tail_plane(self.mtp.attn_index)  # [S, c-1, di]
        saved = tail.index_select(0, first)
        multi, token, drafts = multi0, chain.steps[0].input_ids, []
        for step in chain.steps:
            step = DecodeBatch(token, step.positions, step.cache)
            rope = self.model.rope(step.positions, dtype, True)
            multi = self.mtp.decode(multi, lookup_rows(self.embed, token), step, rope)
            token = self._greedy(multi)
            drafts.append(token)
        # NOTE: the chain's tail rows belong to positions past the committed ones (see the NOTE above).
        tail.index_copy_(0, first, saved)
        return torch.stack(drafts)

    def _prefill_rows(self, it: MtpRows, hidden: torch.Tensor) -> tuple[int, torch.Tensor, list[int]]:
        """The committed MTP rows of it: (first position, streams [m, nH], the token after each [m]):
        rows start-1 .. end-2, row start-1's streams from the slot (none before position 0)."""
        if it.start == 0:
            return 0, it.streams[:-1], it.ids[1:]
        streams = torch.cat([hidden[it.cache.slot][None], it.streams[:-1]])  # [n, nH]
        return it.start - 1, streams, it.ids

    def _forward(self, rows: list[tuple[SequenceCache, int, torch.Tensor, list[int]]], ri: bool) -> None:
        """MTP rows (cache, first position, streams, next ids) of several sequences in one forward."""
        ids, positions, spans = [], [], []
        for cache, start, _, nxt in rows:
            ids += nxt
            positions += range(start, start + len(nxt))
            spans.append(SeqChunk(cache, start, len(nxt)))
        dev = rows[0][2].device
        ids_t = upload(ids, torch.long, dev)
        pos_t = upload(positions, torch.long, dev)
        streams = rows[0][2] if len(rows) == 1 else torch.cat([r[2] for r in rows])
        embed = lookup_rows(self.embed, ids_t)  # [T, H]
        batch = ForwardBatch(ids_t, pos_t, spans, ri)
        self.mtp(streams, embed, batch, self.model.rope(pos_t, streams.dtype, ri))

    def _greedy(self, multi: torch.Tensor) -> torch.Tensor:
        """multi_hidden [B, nH] -> each row's greedy draft [B] (the MTP mixer, then the target's lm_head)."""
        return linear(self.mtp.sample_hidden(multi, True), self.model.lm_head.weight, True).argmax(dim=-1)


def _chain_of(it: MtpRows) -> int:
    """Drafts to chain after `it` (none without a sampled token to start from)."""
    return it.chain if it.sampled is not None else 0


def _truncated(drafts: torch.Tensor, items: list[MtpRows]) -> list[tuple[int, ...]]:
    """Each item's chain from drafts [k, B] (its first _chain_of(item) steps)."""
    rows = drafts.tolist()  # [k][B]
    return [tuple(rows[j][b] for j in range(_chain_of(it))) for b, it in enumerate(items)]
