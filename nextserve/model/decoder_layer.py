"""One decoder layer: [PLE] -> HC(GDN or QSA) -> HC(MoE). No input/post-attention norms."""

import torch
from torch import nn

from ..config import GDN, ModelConfig
from .batch import DecodeBatch, ForwardBatch, WindowBatch
from .gated_deltanet import GatedDeltaNet
from .hyper import GatedResidual
from .moe import SparseMoe
from .ple import PLE
from .qsa import QSAttention


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, kind_index: int, ple_index: int | None) -> None:
        super().__init__()
        self.is_gdn = layer_type == GDN
        if self.is_gdn:
            self.linear_attn = GatedDeltaNet(cfg, kind_index)
        else:
            self.self_attn = QSAttention(cfg, kind_index)
        self.mlp = SparseMoe(cfg)
        self.ple = PLE(cfg, ple_index) if ple_index is not None else None
        self.attn_hyper_connection = GatedResidual(cfg)
        self.mlp_hyper_connection = GatedResidual(cfg)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope) -> torch.Tensor:
        """x [T, nH] streams -> [T, nH]."""
        ri = batch.row_invariant
        x = self._mixer(x, batch, rope)
        return self.mlp_hyper_connection(x, lambda u: self.mlp(u, ri), ri)

    def _mixer(self, x: torch.Tensor, batch: ForwardBatch, rope) -> torch.Tensor:
        """[PLE] and the token mixer (GDN or QSA) with its hyper-connection: x [T, nH] -> [T, nH]."""
        ri = batch.row_invariant
        if self.ple is not None:
            x = x + self.ple(x, batch)
        if self.is_gdn:
            return self.attn_hyper_connection(x, lambda u: self.linear_attn(u, batch), ri)
        return self.attn_hyper_connection(x, lambda u: self.self_attn(u, batch, *rope), ri)

    def forward_chunks(
        self, xs: list[torch.Tensor], batches: list[ForwardBatch], ropes: list
    ) -> list[torch.Tensor]:
        """Prefill chunks of equal length, each with its one-chunk batch and rope (in order: a sequence's
        chunks read the state its earlier ones leave): every op as `forward` runs it on that chunk alone,
        except the routed experts, one call for all (SparseMoe.forward_chunks)."""
        xs = [self._mixer(x, b, r) for x, b, r in zip(xs, batches, ropes, strict=True)]
        return self.mlp_hyper_connection.forward_chunks(xs, self.mlp.forward_chunks)

    def decode(self, x: torch.Tensor, batch: DecodeBatch, rope) -> torch.Tensor:
        """x [B, nH] streams of decode rows -> [B, nH]; every op row-invariant."""
        return self.window(x, WindowBatch.of(batch), rope)

    def window(self, x: torch.Tensor, batch: WindowBatch, rope) -> torch.Tensor:
        """x [W*B, nH] streams of W decode steps' rows (WindowBatch) -> [W*B, nH]; every op row-invariant."""
        if self.ple is not None:
            x = x + self.ple.window(x, batch)
        if self.is_gdn:
            x = self.attn_hyper_connection(x, lambda u: self.linear_attn.window(u, batch), True)
        else:
            x = self.attn_hyper_connection(x, lambda u: self.self_attn.window(u, batch, *rope), True)
        return self.mlp_hyper_connection(x, lambda u: self.mlp(u, True), True)
