"""Gated DeltaNet linear-attention block."""

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops.conv import causal_conv
from ..ops.gdn import gated_delta_rule
from ..ops.linear import linear
from ..ops.norms import rms_norm_gated
from ..ops.pointwise import rowwise
from .batch import ForwardBatch
from .params import Weight


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, gdn_index: int) -> None:
        super().__init__()
        self.gdn_index = gdn_index
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.eps, self.gate_act = cfg.rms_norm_eps, cfg.output_gate
        H, conv_dim, vdim = cfg.hidden_size, cfg.gdn_conv_dim, self.hv * self.dv
        self.in_proj_qkv = Weight(conv_dim, H)
        self.in_proj_z = Weight(vdim, H)
        self.in_proj_b = Weight(self.hv, H)
        self.in_proj_a = Weight(self.hv, H)
        self.conv1d = Weight(conv_dim, 1, cfg.linear_conv_kernel_dim)
        self.A_log = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.norm = Weight(self.dv)
        self.out_proj = Weight(H, vdim)

    def forward(self, u: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        ri = batch.row_invariant
        T = u.shape[0]
        qkv = linear(u, self.in_proj_qkv.weight, ri)  # [T, conv_dim]
        z = linear(u, self.in_proj_z.weight, ri).view(T, self.hv, self.dv)
        beta = rowwise(torch.sigmoid, linear(u, self.in_proj_b.weight, ri), ri)  # [T, Hv]
        a = linear(u, self.in_proj_a.weight, ri)
        g = -self.A_log.float().exp() * rowwise(F.softplus, a.float() + self.dt_bias, ri)  # [T, Hv]
        conv_w = self.conv1d.weight[:, 0, :]  # [C, K]
        kd = self.hk * self.dk
        core = []
        for chunk, (s, e) in zip(batch.chunks, batch.spans(), strict=True):
            conv_hist, rec = chunk.cache.gdn_state(self.gdn_index)
            x, new_hist = causal_conv(qkv[s:e], conv_hist, conv_w)
            conv_hist.copy_(new_hist)
            x = F.silu(x)
            n = e - s
            q = x[:, :kd].reshape(n, self.hk, self.dk)
            k = x[:, kd : 2 * kd].reshape(n, self.hk, self.dk)
            v = x[:, 2 * kd :].reshape(n, self.hv, self.dv)
            o, new_rec = gated_delta_rule(q, k, v, g[s:e], beta[s:e], rec)
            rec.copy_(new_rec)
            core.append(o)
        o = torch.cat(core, dim=0)  # [T, Hv, dv]
        o = rms_norm_gated(o, z, self.norm.weight, self.eps, self.gate_act, ri)
        return linear(o.reshape(T, self.hv * self.dv), self.out_proj.weight, ri)
