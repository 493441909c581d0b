"""FlashNextLM: nextserve's FlashNext + MTP modules as trainable parameters, with a batched forward.

`state_dict()` keys, with `runtime_state` below, are nextserve's runtime names (model/loader.py
`expected_shapes(..., with_mtp=True)`), so the trained weights load into the inference model and
write out as a Hugging Face checkpoint (train/checkpoint.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..model.flash_next import FlashNext
from ..model.mtp import MTP
from ..ops.norms import rms_norm
from ..ops.rope import cos_sin
from .layers import layer_forward


class FlashNextLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = FlashNext(cfg)
        self.mtp = MTP(cfg)
        for p in self.parameters():
            p.requires_grad_(True)

    def rope(self, T: int, dtype: torch.dtype, device) -> tuple:
        inv_f = self.model.inv_freq
        cos, sin = cos_sin(torch.arange(T, device=device), inv_f, dtype)
        return cos, sin, inv_f

    def trunk(self, ids: torch.Tensor, aux: dict | None = None) -> torch.Tensor:
        """ids [B, T] -> pre-mixer streams [B, T, nH]."""
        m = self.model
        x = F.embedding(ids, m.embed_tokens.weight).repeat(1, 1, self.cfg.hc_count)
        rope = self.rope(ids.shape[1], x.dtype, ids.device)
        for layer in m.layers.values():
            x = layer_forward(layer, x, ids, rope, aux)
        return x

    def head(self, streams: torch.Tensor) -> torch.Tensor:
        z, _ = self.model.hyper_connection_mixer.mix(streams, False)
        return F.linear(z, self.model.lm_head.weight)

    def mtp_multi(
        self, streams: torch.Tensor, next_ids: torch.Tensor, aux: dict | None = None
    ) -> torch.Tensor:
        """MTP over rows 0..T-1 (positions 0..T-1): row t takes the target's pre-mixer streams at t and
        the embedding of token t+1 (next_ids[:, t]). Returns multi_hidden [B, T, nH]."""
        mtp, cfg = self.mtp, self.cfg
        B, T, _ = streams.shape
        n, H = cfg.hc_count, cfg.hidden_size
        h = rms_norm(streams, mtp.pre_fc_norm_hidden.weight, mtp.eps)  # joint over n*H
        h = F.linear(h.view(B, T, n, H), mtp.fc_hidden.weight)
        e = rms_norm(
            F.embedding(next_ids, self.model.embed_tokens.weight), mtp.pre_fc_norm_embedding.weight, mtp.eps
        )
        x = (h + F.linear(e, mtp.fc_embedding.weight).unsqueeze(2)).flatten(-2)
        return layer_forward(mtp.layer, x, next_ids, self.rope(T, x.dtype, x.device), aux)

    def mtp_head(self, multi: torch.Tensor) -> torch.Tensor:
        z, _ = self.mtp.hyper_connection_mixer.mix(multi, False)
        return F.linear(z, self.model.lm_head.weight)

    def forward(self, ids: torch.Tensor, aux: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] -> (logits [B, T, V] for tokens 1..T, MTP logits [B, T-1, V] for tokens 2..T+1:
        MTP row t predicts token t+2)."""
        x = self.trunk(ids, aux)
        logits = self.head(x)
        multi = self.mtp_multi(x[:, :-1], ids[:, 1:], aux)
        return logits, self.mtp_head(multi)


def runtime_state(model: FlashNextLM) -> dict[str, torch.Tensor]:
    """Trained tensors keyed by nextserve's runtime names (`embed_tokens.weight`, `layers.0...`,
    `mtp.layer....`)."""
    out = {k: v.detach() for k, v in model.model.state_dict().items()}
    out |= {f"mtp.{k}": v.detach() for k, v in model.mtp.state_dict().items()}
    return out


@torch.no_grad()
def init_weights(model: FlashNextLM, seed: int) -> None:
    """A standard small-transformer init, in parameter-name order from one seeded generator.

    (1+w) norms start at 0 (identity), the GDN output norm at 1, A_log = log U(1, 16), dt_bias as
    transformers' Qwen3-Next; projections N(0, 1/fan_in) with block outputs scaled down by
    1/sqrt(2 L) so the residual streams start tame; PLE conv at 0 as in transformers."""
    gen = torch.Generator().manual_seed(seed)
    L = model.cfg.num_hidden_layers + 1
    for name, p in sorted(model.named_parameters()):
        shape = p.shape

        def normal(std: float, shape=shape) -> torch.Tensor:
            return torch.randn(shape, generator=gen) * std

        if name.endswith("linear_attn.norm.weight"):
            v = torch.ones(shape)
        elif name.endswith("A_log"):
            v = torch.empty(shape).uniform_(1, 16, generator=gen).log()
        elif name.endswith("dt_bias"):
            dt = torch.exp(
                torch.rand(shape, generator=gen) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)
            )
            v = dt + torch.log(-torch.expm1(-dt))
        elif p.dim() == 1 or "norm" in name.rsplit(".", 2)[-2]:
            v = torch.zeros(shape)
        elif name.endswith("ple.conv1d.weight"):
            v = torch.zeros(shape)
        elif name.endswith("linear_attn.conv1d.weight"):
            v = normal(1 / math.sqrt(shape[-1]))
        elif name.endswith("embed_tokens.weight") or "ngram_embedding" in name:
            v = normal(1.0)
        elif name.endswith("lm_head.weight"):
            v = normal(1 / math.sqrt(shape[-1]))
        elif name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight", "down_proj")):
            v = normal(1 / math.sqrt(shape[-1] * 2 * L))
        else:
            v = normal(1 / math.sqrt(shape[-1]))
        p.copy_(v.to(p.dtype))
