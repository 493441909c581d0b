"""Hyper-connections: n residual streams mixed into one block input, the output injected back."""

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.hyper import down_silu, inject, scaled_silu, up_mix
from ..ops.linear import linear
from ..ops.norms import rms_norm
from .params import Weight, fuse_rows, project


class GatedResidual(nn.Module):
    def __init__(self, cfg: ModelConfig, inject: bool = True) -> None:
        super().__init__()
        self.n, self.hidden, self.eps = cfg.hc_count, cfg.hidden_size, cfg.rms_norm_eps
        nH = cfg.hc_hidden
        self.hc_norm = Weight(nH)
        self.input_mix_weight_down = Weight(cfg.hc_lowrank, nH)
        self.input_mix_weight_up = Weight(nH, cfg.hc_lowrank)
        self.block_inject_weight = Weight(self.n, nH) if inject else None
        self.in_proj: torch.Tensor | None = None  # down|inject stacked by fuse()

    def fuse(self) -> None:
        if self.block_inject_weight is not None:
            # NOTE: zero rows up to a multiple of 8 (324 -> 328 in Flash-Next): a prefill GEMM's output
            # rows then stay 16-byte aligned for cuBLAS; decode rows read the unpadded rows (a view)
            self.in_proj = fuse_rows(self.input_mix_weight_down, self.block_inject_weight, align=8)

    def mix(self, x: torch.Tensor, ri: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, nH] -> (block input u [T, H], injection logits W_inj X^ [T, n], None without inject)."""
        xn = rms_norm(x, self.hc_norm.weight, self.eps, group=self.hidden)  # per-stream G-norm
        r = self.input_mix_weight_down.weight.shape[0]
        if self.block_inject_weight is None:
            a, v = down_silu(xn, self.input_mix_weight_down.weight, r, self.n, ri), None
        elif self.in_proj is not None and ri:  # both read X^: one GEMV over their stack (vLLM merges them)
            av = down_silu(xn, self.in_proj[: r + self.n], r, self.n, ri)  # [T, r + n]: silu(down/n) | inj
            a, v = av[:, :r], av[:, r:]
        elif self.in_proj is not None:  # a prefill chunk: one GEMM over the padded stack
            y = linear(xn, self.in_proj)  # [T, r + n + padding]
            a, v = scaled_silu(y[:, :r], self.n), y[:, r : r + self.n]
        else:
            down, v = project(xn, (self.input_mix_weight_down, self.block_inject_weight), None, ri)
            a = scaled_silu(down, self.n, ri)  # [T, r]
        # mean_s sigmoid(W_up a)_s * xn_s; a may be a column slice
        u = up_mix(a, self.input_mix_weight_up.weight, xn, self.n, self.hidden, ri)  # [T, H]
        return u, v

    def forward(self, x: torch.Tensor, block, ri: bool) -> torch.Tensor:
        """X_s <- X_s + inj_s * block(u), inj = 2 sigmoid(W_inj X^ / n) from the pre-block streams."""
        u, v = self.mix(x, ri)  # v [T, n]
        y = block(u)  # [T, H]
        return inject(x, y, v, self.n, ri)

    def forward_chunks(self, xs: list[torch.Tensor], block_chunks) -> list[torch.Tensor]:
        """`forward` of prefill chunks xs[i] [n_i, nH], each as alone; block_chunks maps their block inputs
        (a list) to their block outputs (a list) at once."""
        mixes = [self.mix(x, False) for x in xs]
        ys = block_chunks([u for u, _ in mixes])
        return [inject(x, y, v, self.n, False) for x, y, (_, v) in zip(xs, ys, mixes, strict=True)]
