"""PLE: hashed n-gram embeddings (with eos reset) gated into every stream, plus a dilated conv."""

import math

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.conv import conv_chunk, conv_step, conv_window
from ..ops.fp8 import Fp8Weight
from ..ops.norms import rms_norm
from ..ops.ple import lookup_rows, ngram_contexts, ngram_ids, ple_decode_ids, ple_gate
from .batch import DecodeBatch, ForwardBatch, WindowBatch, cat_rows
from .params import Projection, Weight, fuse_rows, project

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & _MASK64


def multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + 10007 * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(v: int) -> bool:
    if v < 2 or v % 2 == 0:
        return v == 2
    return all(v % d for d in range(3, math.isqrt(v) + 1, 2))


def head_vocab_sizes(base: int, ple_index: int, n_heads: int) -> list[int]:
    """Head g (global index ple_index*n_heads + g) uses the (global+1)-th prime >= base."""
    sizes, p = [], base - 1
    for _ in range(ple_index * n_heads + n_heads):
        p += 1
        while not _is_prime(p):
            p += 1
        sizes.append(p)
    return sizes[ple_index * n_heads :]


def table_rows(cfg: ModelConfig, ple_index: int) -> int:
    """Rows of one PLE table: all its heads' vocabularies, padded to the configured divisor."""
    total = sum(head_vocab_sizes(cfg.ngram_vocab_size_base, ple_index, cfg.ple_num_heads))
    div = cfg.make_ngram_vocab_size_divisible_by
    return math.ceil(total / div) * div


class NGramEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, ple_index: int) -> None:
        super().__init__()
        self.N, self.per_order, self.eos = cfg.ngram_size, cfg.heads_per_ngram, cfg.eos_token_id
        n_heads = cfg.ple_num_heads
        sizes = head_vocab_sizes(cfg.ngram_vocab_size_base, ple_index, n_heads)
        offsets = [sum(sizes[:i]) for i in range(n_heads)]
        rows = table_rows(cfg, ple_index)
        # NOTE: recomputed from the config, never loaded: the checkpoint's copies are ignored.
        mult = multipliers(cfg.vocab_size, self.N, ple_index, cfg.seed)
        self._buffers_of = (mult, sizes, offsets)
        self.register_buffer("mult", torch.tensor(mult, dtype=torch.long), persistent=False)
        self.register_buffer("sizes", torch.tensor(sizes, dtype=torch.long), persistent=False)
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.long), persistent=False)
        self.ngram_embedding = Weight(rows, cfg.ple_embed_dim // n_heads)

    def init_buffers(self, device: torch.device | str) -> None:
        """The hash buffers on device (after a meta-device build: model/loader.materialize)."""
        for name, values in zip(("mult", "sizes", "offsets"), self._buffers_of, strict=True):
            setattr(self, name, torch.tensor(values, dtype=torch.long, device=device))

    def ids(self, contexts: torch.Tensor) -> torch.Tensor:
        """contexts [T, N] -> table rows [T, n_heads]: order-k heads hash XOR_{i<k} c_i * m_i."""
        return ngram_ids(contexts, self.mult, self.sizes, self.offsets, self.per_order)


class PLE(nn.Module):
    def __init__(self, cfg: ModelConfig, ple_index: int) -> None:
        super().__init__()
        self.ple_index, self.n, self.hidden, self.eps = (
            ple_index,
            cfg.hc_count,
            cfg.hidden_size,
            cfg.rms_norm_eps,
        )
        self.N = cfg.ngram_size
        D, nH = cfg.ple_embed_dim, cfg.hc_hidden
        self.ple_embedding = NGramEmbedding(cfg, ple_index)
        self.key_proj = Projection(nH, D)
        self.value_proj = Projection(cfg.hidden_size, D)
        self.norm_key = Weight(nH)
        self.norm_query = Weight(nH)
        self.norm_conv = Weight(nH)
        self.conv1d = Weight(nH, 1, cfg.ple_conv_kernel_size)
        self.kv_proj: torch.Tensor | Fp8Weight | None = None  # key|value stacked by fuse()

    def fuse(self) -> None:
        self.kv_proj = fuse_rows(self.key_proj, self.value_proj)

    def _gated(self, ids: torch.Tensor, x: torch.Tensor, ri: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Table rows [T, heads], streams x [T, nH] -> (gated value [T, nH], its G-norm: the conv input)."""
        n, H = self.n, self.hidden
        e_vec = lookup_rows(self.ple_embedding.ngram_embedding.weight, ids).flatten(-2)  # [T, D]
        key, value = project(e_vec, (self.key_proj, self.value_proj), self.kv_proj, ri)
        key = rms_norm(key, self.norm_key.weight, self.eps, H)  # value [T, H]
        query = rms_norm(x, self.norm_query.weight, self.eps, H)
        gated = ple_gate(key, query, value, n, H, ri)  # [T, nH]
        return gated, rms_norm(gated, self.norm_conv.weight, self.eps, H)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [T, nH] -> PLE contribution [T, nH] (gated value + conv), updating context and history."""
        ri, emb = batch.row_invariant, self.ple_embedding
        rows = []
        for chunk, (s, e) in zip(batch.chunks, batch.spans(), strict=True):
            ctx, _ = chunk.cache.ple_state(self.ple_index)
            hist = torch.cat([ctx, batch.input_ids[s:e]])
            rows.append(emb.ids(ngram_contexts(hist, e - s, self.N, emb.eos)))
            ctx.copy_(hist[-ctx.shape[0] :])
        gated, normed = self._gated(torch.cat(rows), x, ri)
        conv_w = self.conv1d.weight[:, 0, :]
        convs = []
        for chunk, (s, e) in zip(batch.chunks, batch.spans(), strict=True):
            _, conv_hist = chunk.cache.ple_state(self.ple_index)
            if ri:  # a verify window: decode's conv, token by token (C1)
                convs.append(conv_window(normed[s:e], conv_hist, conv_w, self.N, silu=True))
                continue
            out, new_hist = conv_chunk(normed[s:e], conv_hist, conv_w, self.N, silu=True)
            conv_hist.copy_(new_hist)
            convs.append(out)
        return gated + cat_rows(convs)

    def decode(self, x: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """One token per row; contexts and conv histories read and written through the rows' slots."""
        return self.window(x, WindowBatch.of(batch))

    def window(self, x: torch.Tensor, batch: WindowBatch) -> torch.Tensor:
        """W decode steps' rows [W*B, nH]: n-gram contexts and the conv step by step on the rows' slots
        (each step's state kept for a rewind), the embeddings and the gate on all rows."""
        emb = self.ple_embedding
        ids = []
        for _, step in batch.rows():
            ctx_plane, _ = step.cache.ple_planes(self.ple_index)
            ids.append(
                ple_decode_ids(
                    ctx_plane,
                    step.cache.slots,
                    step.input_ids,
                    emb.mult,
                    emb.sizes,
                    emb.offsets,
                    emb.eos,
                    emb.per_order,
                )  # fmt: skip
            )  # [B, heads]; the slots' contexts now end with the step's tokens
            step.cache.keep_state(ctx_plane)
        gated, normed = self._gated(cat_rows(ids), x, True)
        conv_w, convs = self.conv1d.weight[:, 0, :], []
        for rows, step in batch.rows():
            _, conv_plane = step.cache.ple_planes(self.ple_index)
            convs.append(conv_step(normed[rows], conv_plane, step.cache.slots, conv_w, self.N, silu=True))
            step.cache.keep_state(conv_plane)
        return gated + cat_rows(convs)
