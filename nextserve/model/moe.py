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
        self.in_proj: torch.Tensor | None = None  # router|shared-expert gate|shared gate|shared up
        # NOTE: a config property, never a batch one, so a row's bits never depend on the batch (C1)
        self.shared_as_expert = cfg.shared_expert_intermediate_size == cfg.moe_intermediate_size

    def _parts(self) -> tuple[Weight, ...]:
        se = self.shared_expert
        return (self.gate, self.shared_expert_gate, se.gate_proj, se.up_proj)

    def fuse(self) -> None:
        self.in_proj = fuse_rows(*self._parts())

    def forward(self, u: torch.Tensor, ri: bool) -> torch.Tensor:
        if ri and self.shared_as_expert and self.in_proj is not None:
            return self._decode(u)
        router, sg, g, up = project(u, self._parts(), self.in_proj, ri)
        shared = self.shared_expert(u, ri, (g, up))
        w, ids = route(router, self.top_k, self.norm_topk, ri)
        routed = experts(u, w, ids, self.experts.gate_up_proj, self.experts.down_proj, ri)
        return sigmoid_gate(shared, sg, routed, ri)  # routed + sigmoid(sg) * shared

    def _decode(self, u: torch.Tensor) -> torch.Tensor:
        """Row-invariant rows (decode, verify windows) of a fused model (`fuse`) whose shared expert has
        the routed experts' width (Flash-Next: 640 both): it runs as one more routed expert (id E,
        weight sigmoid(sg), added last: the same roundings as sigmoid_gate), so its projections ride the
        grouped expert kernels instead of a GEMV, an activation and a gate of their own."""
        E, se = self.gate.weight.shape[0], self.shared_expert
        # NOTE: views of the stack (fuse): router|sg rows, then the shared expert's gate|up rows
        logits = linear(u, self.in_proj[: E + 1], True)
        shared_gate_up = self.in_proj[E + 1 :]
        w, ids = route(logits, self.top_k, self.norm_topk, True, shared=True)  # [T, k + 1]
        ex = self.experts
        return experts(u, w, ids, ex.gate_up_proj, ex.down_proj, True, (shared_gate_up, se.down_proj.weight))
