"""Sparse MoE with a sigmoid-gated shared expert."""

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.linear import linear
from ..ops.moe import experts, route
from ..ops.pointwise import sigmoid_gate, silu_mul
from .params import Weight, fuse_rows, project


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

    def forward(self, x: torch.Tensor, ri: bool, gate_up=None) -> torch.Tensor:
        """x [T, H] (or its gate and up projections, given) -> [T, H]."""
        if gate_up is None:
            gate_up = (linear(x, self.gate_proj.weight, ri), linear(x, self.up_proj.weight, ri))
        g, up = gate_up
        return linear(silu_mul(g, up, ri), self.down_proj.weight, ri)


class SparseMoe(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Weight(cfg.num_experts, cfg.hidden_size)
        self.experts = Experts(cfg)
        self.shared_expert = SharedExpert(cfg)
        self.shared_expert_gate = Weight(1, cfg.hidden_size)
        self.in_proj: torch.Tensor | None = None  # router|shared gate|shared up|shared-expert gate

    def _parts(self) -> tuple[Weight, ...]:
        se = self.shared_expert
        return (self.gate, se.gate_proj, se.up_proj, self.shared_expert_gate)

    def fuse(self) -> None:
        self.in_proj = fuse_rows(*self._parts())

    def forward(self, u: torch.Tensor, ri: bool) -> torch.Tensor:
        router, g, up, sg = project(u, self._parts(), self.in_proj, ri)
        shared = self.shared_expert(u, ri, (g, up))
        w, ids = route(router, self.top_k, self.norm_topk, ri)
        routed = experts(u, w, ids, self.experts.gate_up_proj, self.experts.down_proj, ri)
        return sigmoid_gate(shared, sg, routed, ri)  # routed + sigmoid(sg) * shared
