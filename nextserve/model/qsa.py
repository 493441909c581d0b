"""QSA: gated softmax attention over the tokens an indexer selects (top-k compressed blocks + tail)."""

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.attention import (
    block_mean,
    index_scores,
    indexer_open_block,
    paged_sparse_attention,
    prefill_index_scores,
    prefill_sparse_attention,
    select_decode_tokens,
)
from ..ops.fp8 import Fp8Weight
from ..ops.linear import linear
from ..ops.norms import rms_norm
from ..ops.pointwise import rowwise, sigmoid_gate
from ..ops.rope import apply_rope
from .batch import DecodeBatch, ForwardBatch, KVView, WindowBatch, cat_rows
from .params import Projection, Weight, fuse_rows, project


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ni, self.di = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.c, self.topk, self.eps = cfg.indexer_compress_ratio, cfg.block_topk, cfg.rms_norm_eps
        self.index_qk_proj = Projection((self.ni + 1) * self.di, cfg.hidden_size)
        self.q_layernorm = Weight(self.di)
        self.k_layernorm = Weight(self.di)

    def block_key(
        self, raw: torch.Tensor, block_starts: torch.Tensor, rotary, ri: bool = False
    ) -> torch.Tensor:
        """raw [m, c, di] raw keys of m complete blocks -> compressed keys [m, di]; rotary(positions, dtype)
        gives cos, sin (FlashNext.cos_sin)."""
        return self._pooled_key(block_mean(raw, ri), block_starts, rotary, ri)

    def _pooled_key(self, pooled: torch.Tensor, starts: torch.Tensor, rotary, ri: bool) -> torch.Tensor:
        """Mean raw keys [m, di] of blocks starting at `starts` -> their compressed keys [m, di]."""

        def key(pooled: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
            normed = rms_norm(pooled, self.k_layernorm.weight, self.eps)
            cos, sin = rotary(starts, pooled.dtype)
            return apply_rope(normed[:, None, :], cos, sin)[:, 0, :]

        # NOTE: its reductions and cos/sin run row by row on the CPU in row-invariant mode (pointwise.py).
        return rowwise(key, pooled, ri, starts)

    def _query(self, u: torch.Tensor, cos, sin, ri: bool, qk=None) -> tuple[torch.Tensor, torch.Tensor]:
        """u [T, H] (or its projection qk, given) -> (normed, roped queries [T, Ni, di], raw keys [T, di])."""
        T = u.shape[0]
        if qk is None:
            qk = linear(u, self.index_qk_proj.operand, ri)
        q = qk[:, : self.ni * self.di].view(T, self.ni, self.di)
        q = apply_rope(rms_norm(q, self.q_layernorm.weight, self.eps), cos, sin)
        return q, qk[:, self.ni * self.di :]

    def step(self, q, raw, step: DecodeBatch, attn_index: int, rotary) -> torch.Tensor:
        """Selected token ids [B, block_topk*c + c] int32 (-1 = none) of one decode step's rows, from their
        queries q [B, Ni, di] and raw keys [B, di] (`_query`). Stores each row's raw key in its slot's
        open block (kept for a rewind), and the block's compressed key once it completes."""
        pos, cache = step.positions, step.cache
        tail_plane = cache.index_tail_plane(attn_index)  # [S, c-1, di]
        pooled, starts = indexer_open_block(raw, tail_plane, cache.slots, pos, self.c, True)
        cache.keep_state(tail_plane)
        # NOTE: computed for every row (no branch, so the step can be a graph); it is the block's
        # key only where the row completes its block, and a placeholder elsewhere that the completion
        # overwrites.
        cache.write_block_key(attn_index, self._pooled_key(pooled, starts, rotary, True))
        return self._select(q, pos, cache.kv_view(attn_index))

    def _select(self, q: torch.Tensor, positions: torch.Tensor, view: KVView) -> torch.Tensor:
        """Token ids [T, block_topk*c + c] int32 (-1 = none) each query row attends to: the top blocks
        by indexer score among those complete at its position, then its open block.

        # NOTE: prefill rows and decode rows select with these same ops, row by row (C1)."""
        view = view.rows(q.shape[0])
        n_blocks = torch.div(positions + 1, self.c, rounding_mode="floor")
        scores = index_scores(q, view.block_keys, view.block_table, n_blocks, view.max_blocks)
        return select_decode_tokens(scores, n_blocks, positions, self.c, self.topk)

    def _select_chunk(self, q: torch.Tensor, positions: torch.Tensor, start: int, view: KVView):
        """`_select` of a prefill chunk's rows, positions start .. start+T-1 of one sequence: the same
        rule, scored by the prefill kernel (tiles of rows on tensor cores) on CUDA."""
        scores, n_blocks = prefill_index_scores(q, view.block_keys, view.block_table[0], start, self.c)
        return select_decode_tokens(scores, n_blocks, positions, self.c, self.topk)

    def forward(
        self, u, batch: ForwardBatch, cos, sin, attn_index: int, rotary, qk=None
    ) -> list[list[torch.Tensor]]:
        """Selected token ids for every row, grouped by chunk. Updates block keys and the open tail."""
        q, raw = self._query(u, cos, sin, batch.row_invariant, qk)
        c = self.c
        selected = []
        for chunk, (s, e) in zip(batch.chunks, batch.spans(), strict=True):
            tail = chunk.cache.index_tail(attn_index)  # [c-1, di]
            first_block = chunk.start // c
            n_open = chunk.start - first_block * c
            keys = torch.cat([tail[:n_open], raw[s:e]], dim=0)  # from the open block's start on
            end = chunk.start + chunk.n
            n_new = end // c - first_block
            if n_new > 0:
                blocks = keys[: n_new * c].view(n_new, c, self.di)
                starts = torch.arange(first_block, first_block + n_new, device=u.device) * c
                chunk.cache.write_block_keys(attn_index, first_block, self.block_key(blocks, starts, rotary))
            rest = keys[n_new * c :]
            tail[: rest.shape[0]].copy_(rest)
            view = chunk.cache.kv_view(attn_index)
            if batch.row_invariant:  # decode-sized work: the decode kernels, row by row (C1)
                selected.append(self._select(q[s:e], batch.positions[s:e], view))
            else:
                selected.append(self._select_chunk(q[s:e], batch.positions[s:e], chunk.start, view))
        return selected


class QSAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_index: int) -> None:
        super().__init__()
        self.attn_index = attn_index
        self.nq, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps, self.scaling = cfg.rms_norm_eps, cfg.head_dim**-0.5
        H = cfg.hidden_size
        self.q_proj = Projection(self.nq * 2 * self.d, H)
        self.k_proj = Projection(self.nkv * self.d, H)
        self.v_proj = Projection(self.nkv * self.d, H)
        self.o_proj = Projection(H, self.nq * self.d)
        self.q_norm = Weight(self.d)
        self.k_norm = Weight(self.d)
        self.indexer = Indexer(cfg)
        self.in_proj: torch.Tensor | Fp8Weight | None = None  # q|k|v|indexer qk stacked by fuse()

    def fuse(self) -> None:
        self.in_proj = fuse_rows(self.q_proj, self.k_proj, self.v_proj, self.indexer.index_qk_proj)

    def _project(self, u: torch.Tensor, ri: bool):
        """u [T, H] -> (q|gate, k, v, indexer qk) projections; one GEMV when fused."""
        parts = (self.q_proj, self.k_proj, self.v_proj, self.indexer.index_qk_proj)
        return project(u, parts, self.in_proj, ri)

    def _qkv(self, u: torch.Tensor, cos, sin, ri: bool, proj=None):
        """u [T, H] -> (q [T, Nq, D], gate [T, Nq, D] (a view), k, v [T, Nkv, D]); q and k normed and
        roped."""
        T = u.shape[0]
        qg, k, v, _ = proj if proj is not None else self._project(u, ri)
        qg = qg.reshape(T, self.nq, 2 * self.d)
        q, gate = qg[..., : self.d], qg[..., self.d :]
        q = apply_rope(rms_norm(q, self.q_norm.weight, self.eps), cos, sin)
        k = apply_rope(rms_norm(k.reshape(T, self.nkv, self.d), self.k_norm.weight, self.eps), cos, sin)
        return q, gate, k, v.reshape(T, self.nkv, self.d)

    def _output(self, o: torch.Tensor, gate: torch.Tensor, ri: bool) -> torch.Tensor:
        o = sigmoid_gate(o.reshape(o.shape[0], self.nq * self.d), gate, row_invariant=ri)
        return linear(o, self.o_proj.operand, ri)

    def forward(self, u: torch.Tensor, batch: ForwardBatch, cos, sin, rotary) -> torch.Tensor:
        ri = batch.row_invariant
        proj = self._project(u, ri)
        selected = self.indexer(u, batch, cos, sin, self.attn_index, rotary, qk=proj[3])
        q, gate, k, v = self._qkv(u, cos, sin, ri, proj)
        outs = []
        for chunk, (s, e), tokens in zip(batch.chunks, batch.spans(), selected, strict=True):
            chunk.cache.write_kv(self.attn_index, chunk.start, k[s:e], v[s:e])
            kv = chunk.cache.kv_view(self.attn_index)
            if ri:
                kv = kv.rows(e - s)
                outs.append(paged_sparse_attention(q[s:e], kv.k, kv.v, kv.block_table, tokens, self.scaling))
            else:
                table = kv.block_table[0]
                outs.append(prefill_sparse_attention(q[s:e], kv.k, kv.v, table, tokens, self.scaling))
        return self._output(cat_rows(outs), gate, ri)

    def decode(self, u: torch.Tensor, batch: DecodeBatch, cos, sin, rotary) -> torch.Tensor:
        return self.window(u, WindowBatch.of(batch), cos, sin, rotary)

    def window(self, u: torch.Tensor, batch: WindowBatch, cos, sin, rotary) -> torch.Tensor:
        """W decode steps' rows [W*B, H]: projections, norms and rope on all rows; the indexer's open
        block, the KV writes and the attention step by step, so a row reads the KV and block keys the
        rows before it wrote, as in serial decode."""
        proj = self._project(u, True)
        q_idx, raw = self.indexer._query(u, cos, sin, True, proj[3])
        q, gate, k, v = self._qkv(u, cos, sin, True, proj)
        outs = []
        for rows, step in batch.rows():
            tokens = self.indexer.step(q_idx[rows], raw[rows], step, self.attn_index, rotary)
            step.cache.write_kv(self.attn_index, k[rows], v[rows])
            view = step.cache.kv_view(self.attn_index)
            o = paged_sparse_attention(q[rows], view.k, view.v, view.block_table, tokens, self.scaling)
            outs.append(o)
        return self._output(cat_rows(outs), gate, True)
