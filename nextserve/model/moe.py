"""Sparse MoE with a sigmoid-gated shared expert."""

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops.linear import linear
from ..ops.moe import experts, route
from ..ops.pointwise import rowwise
from .params import Weight


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, I), requires_grad=False)


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H, I = cfg.hidden_size, cfg.shared_expert_intermediate_size
        self.gate_proj = Weight(I, H)
        self.up_proj = Weight(I, H)
        self.down_proj = Weight(H, I)

    def forward(self, x: torch.Tensor, ri: bool) -> torch.Tensor:
        h = rowwise(F.silu, linear(x, self.gate_proj.weight, ri), ri) * linear(x, self.up_proj.weight, ri)
        return linear(h, self.down_proj.weight, ri)


class SparseMoe(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Weight(cfg.num_experts, cfg.hidden_size)
        self.experts = Experts(cfg)
        self.shared_expert = SharedExpert(cfg)
        self.shared_expert_gate = Weight(1, cfg.hidden_size)

    def forward(self, u: torch.Tensor, ri: bool) -> torch.Tensor:
        shared = self.shared_expert(u, ri)
        w, ids = route(linear(u, self.gate.weight, ri), self.top_k, self.norm_topk, ri)
        routed = experts(u, w, ids, self.experts.gate_up_proj, self.experts.down_proj, ri)
        return routed + rowwise(torch.sigmoid, linear(u, self.shared_expert_gate.weight, ri), ri) * shared
