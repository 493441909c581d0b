"""Hyper-connections: n residual streams mixed into one block input, the output injected back."""

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops.linear import linear
from ..ops.norms import rms_norm
from ..ops.pointwise import rowwise
from .params import Weight


class GatedResidual(nn.Module):
    def __init__(self, cfg: ModelConfig, inject: bool = True) -> None:
        super().__init__()
        self.n, self.hidden, self.eps = cfg.hc_count, cfg.hidden_size, cfg.rms_norm_eps
        nH = cfg.hc_hidden
        self.hc_norm = Weight(nH)
        self.input_mix_weight_down = Weight(cfg.hc_lowrank, nH)
        self.input_mix_weight_up = Weight(nH, cfg.hc_lowrank)
        self.block_inject_weight = Weight(self.n, nH) if inject else None

    def mix(self, x: torch.Tensor, ri: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, nH] -> (block input u [T, H], normed streams [T, nH])."""
        xn = rms_norm(x, self.hc_norm.weight, self.eps, group=self.hidden)  # per-stream G-norm
        a = rowwise(F.silu, linear(xn, self.input_mix_weight_down.weight, ri) / self.n, ri)  # [T, r]
        gate = rowwise(torch.sigmoid, linear(a, self.input_mix_weight_up.weight, ri), ri)  # [T, nH]
        u = (gate.unflatten(-1, (self.n, self.hidden)) * xn.unflatten(-1, (self.n, self.hidden))).mean(dim=-2)
        return u, xn

    def forward(self, x: torch.Tensor, block, ri: bool) -> torch.Tensor:
        """X_s <- X_s + inj_s * block(u), inj = 2 sigmoid(W_inj X^ / n) from the pre-block streams."""
        u, xn = self.mix(x, ri)
        inj = 2 * rowwise(
            torch.sigmoid, linear(xn, self.block_inject_weight.weight, ri) / self.n, ri
        )  # [T, n]
        y = block(u)  # [T, H]
        return x + (y.unsqueeze(-2) * inj.unsqueeze(-1)).flatten(-2)
