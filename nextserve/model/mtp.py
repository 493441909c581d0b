"""The MTP draft block (FLASH_NEXT.md section 2): one QSA decoder layer fed with the target's
pre-mixer streams and the next token, chained to draft several tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import QSA, ConfigError, ModelConfig
from ..ops.linear import linear
from ..ops.norms import rms_norm
from .batch import DecodeBatch, ForwardBatch, SeqChunk, WindowBatch
from .decoder_layer import DecoderLayer
from .hyper import GatedResidual
from .params import Projection, Weight


class MTP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.index_share_for_mtp_iteration:
            raise ConfigError(
                "index_share_for_mtp_iteration=true is not supported yet (draft steps >= 1 would differ)"
            )
        H = cfg.hidden_size
        self.cfg, self.n, self.hidden, self.eps = cfg, cfg.hc_count, H, cfg.rms_norm_eps
        self.fc_embedding = Projection(H, H)
        self.fc_hidden = Projection(H, H)
        self.pre_fc_norm_embedding = Weight(H)
        self.pre_fc_norm_hidden = Weight(cfg.hc_hidden)
        self.hyper_connection_mixer = GatedResidual(cfg, inject=False)
        # NOTE: its KV planes come after the main QSA layers' (attention index n_qsa).
        self.layer = DecoderLayer(cfg, QSA, len(cfg.qsa_layers), None)

    @property
    def attn_index(self) -> int:
        return len(self.cfg.qsa_layers)

    def fuse_projections(self) -> None:
        """Stack the projections that read one input, as FlashNext.fuse_projections; after loading."""
        for m in self.modules():
            if m is not self and hasattr(m, "fuse"):
                m.fuse()

    def _fuse_inputs(self, streams: torch.Tensor, next_embed: torch.Tensor, ri: bool) -> torch.Tensor:
        """X0_s = fc_hidden(G-norm_nH(streams))_s + fc_embedding(G-norm_H(next_embed)) -> [T, nH]."""
        T = streams.shape[0]
        h = rms_norm(streams, self.pre_fc_norm_hidden.weight, self.eps)  # joint over all n*H
        h = linear(h.reshape(T * self.n, self.hidden), self.fc_hidden.operand, ri).view(
            T, self.n, self.hidden
        )
        e = rms_norm(next_embed, self.pre_fc_norm_embedding.weight, self.eps)
        return (h + linear(e, self.fc_embedding.operand, ri).unsqueeze(1)).flatten(-2)  # [T, nH]

    def forward(
        self, streams: torch.Tensor, next_embed: torch.Tensor, batch: ForwardBatch, rope
    ) -> torch.Tensor:
        """streams [T, nH]: the target's (or the previous step's) pre-mixer streams at each row's
        position; next_embed [T, H]: embedding of the token after it. Returns multi_hidden [T, nH]."""
        return self.layer(self._fuse_inputs(streams, next_embed, batch.row_invariant), batch, rope)

    def decode(
        self, streams: torch.Tensor, next_embed: torch.Tensor, batch: DecodeBatch, rope
    ) -> torch.Tensor:
        """One row per sequence (distinct sequences), row-invariant, as FlashNext.decode: streams
        [B, nH], next_embed [B, H] -> multi_hidden [B, nH]."""
        return self.layer.decode(self._fuse_inputs(streams, next_embed, True), batch, rope)

    def window(
        self, streams: torch.Tensor, next_embed: torch.Tensor, batch: WindowBatch, rope
    ) -> torch.Tensor:
        """W decode steps' rows (WindowBatch), as FlashNext.window: streams [W*B, nH], next_embed [W*B, H]
        -> multi_hidden [W*B, nH]."""
        return self.layer.window(self._fuse_inputs(streams, next_embed, True), batch, rope)

    def sample_hidden(self, multi: torch.Tensor, row_invariant: bool = True) -> torch.Tensor:
        return self.hyper_connection_mixer.mix(multi, row_invariant)[0]

    @torch.no_grad()
    def draft(
        self, model, streams: torch.Tensor, token: int, position: int, cache, k: int
    ) -> tuple[list[int], torch.Tensor]:
        """Greedy chain of k drafts after `token` at `position` + 1.

        streams [1, nH]: the target's pre-mixer streams at `position` (whose sampled successor is
        `token`). Step j feeds the previous step's multi_hidden and draft at position + j and writes
        the MTP KV there. Returns (drafts, logits [k, V])."""
        drafts, all_logits = [], []
        ids = torch.tensor([token], device=streams.device)
        for j in range(k):
            pos = torch.tensor([position + j], device=streams.device)
            batch = ForwardBatch(ids, pos, [SeqChunk(cache, position + j, 1)], row_invariant=True)
            embed = F.embedding(ids, model.embed_tokens.weight)
            streams = self(streams, embed, batch, model.rope(pos, streams.dtype, True))
            logits = linear(self.sample_hidden(streams), model.lm_head.operand, True)
            all_logits.append(logits)
            ids = logits.argmax(dim=-1)
            drafts.append(int(ids.item()))
        return drafts, torch.cat(all_logits)
