"""Sparse MoE with a sigmoid-gated shared expert."""

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.fp8 import Fp8Weight
from ..ops.int4 import Int4Weight
from ..ops.linear import linear
from ..ops.moe import experts, experts_of_chunks, route, weight_form
from ..ops.pointwise import sigmoid_gate, silu_mul
from .params import Projection, fuse_rows, operand_of, project


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, I), requires_grad=False)

    @property
    def gate_up(self) -> torch.Tensor | Fp8Weight:
        return operand_of(self, "gate_up_proj")

    @property
    def down(self) -> torch.Tensor | Fp8Weight:
        return operand_of(self, "down_proj")


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H, I = cfg.hidden_size, cfg.shared_expert_intermediate_size
        self.gate_proj = Projection(I, H)
        self.up_proj = Projection(I, H)
        self.down_proj = Projection(H, I)

    def forward(self, x: torch.Tensor, ri: bool, gate_up=None) -> torch.Tensor:
        """x [T, H] (or its gate and up projections, given) -> [T, H]."""
        if gate_up is None:
            gate_up = (linear(x, self.gate_proj.operand, ri), linear(x, self.up_proj.operand, ri))
        g, up = gate_up
        return linear(silu_mul(g, up, ri), self.down_proj.operand, ri)


class SparseMoe(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Projection(cfg.num_experts, cfg.hidden_size)
        self.experts = Experts(cfg)
        self.shared_expert = SharedExpert(cfg)
        self.shared_expert_gate = Projection(1, cfg.hidden_size)
        self.in_proj: torch.Tensor | None = None  # router|shared-expert gate|shared gate|shared up
        # with an FP8 shared expert and a plain router (they do not stack): router|sg, and gate|up
        self.router_proj: torch.Tensor | Fp8Weight | None = None
        self.shared_gate_up: torch.Tensor | Fp8Weight | None = None
        # NOTE: a config property, never a batch one, so a row's bits never depend on the batch (C1)
        self.shared_as_expert = cfg.shared_expert_intermediate_size == cfg.moe_intermediate_size

    def _parts(self) -> tuple[Projection, ...]:
        se = self.shared_expert
        return (self.gate, self.shared_expert_gate, se.gate_proj, se.up_proj)

    def fuse(self) -> None:
        parts = self._parts()
        if not any(isinstance(p.operand, Fp8Weight | Int4Weight) for p in parts):
            # NOTE: 1,793 rows in Flash-Next: a prefill GEMM with an output row of an odd length ran
            # cuBLAS's unaligned kernel (0.4 ms a 4,096-token chunk, 6x the aligned one)
            self.in_proj = fuse_rows(*parts, align=8)
            return
        se = self.shared_expert
        self.router_proj = fuse_rows(self.gate, self.shared_expert_gate, align=8)
        self.shared_gate_up = fuse_rows(se.gate_proj, se.up_proj)

    def _decode_weights(self) -> tuple[torch.Tensor | Fp8Weight, torch.Tensor | Fp8Weight] | None:
        """(router|sg rows, the shared expert's gate|up rows) for `_decode`, or None when not fused (or
        when the shared expert is not stored like the routed ones, so it cannot ride their kernels)."""
        E = self.gate.weight.shape[0]
        if self.in_proj is not None:  # NOTE: views of the stack (fuse), without its padding rows
            n = E + 1 + 2 * self.shared_expert.gate_proj.weight.shape[0]
            fused = self.in_proj[: E + 1], self.in_proj[E + 1 : n]
        elif self.router_proj is not None and self.shared_gate_up is not None:
            router = self.router_proj
            fused = router if isinstance(router, Fp8Weight) else router[: E + 1], self.shared_gate_up
        else:
            return None
        ex = self.experts
        kinds = {
            weight_form(w) for w in (fused[1], self.shared_expert.down_proj.operand, ex.gate_up, ex.down)
        }
        return fused if len(kinds) == 1 else None

    def forward(self, u: torch.Tensor, ri: bool) -> torch.Tensor:
        if ri and self.shared_as_expert and (fused := self._decode_weights()) is not None:
            return self._decode(u, *fused)
        router, sg, g, up = self._project(u, ri)
        shared = self.shared_expert(u, ri, (g, up))
        w, ids = route(router, self.top_k, self.norm_topk, ri)
        routed = experts(u, w, ids, self.experts.gate_up, self.experts.down, ri)
        return sigmoid_gate(shared, sg, routed, ri)  # routed + sigmoid(sg) * shared

    def forward_chunks(self, us: list[torch.Tensor]) -> list[torch.Tensor]:
        """Prefill chunks of equal length us[i] [n, H], each computed as `forward` computes it alone, except
        that the routed experts of all of them run as one grouped call (ops.moe.experts_of_chunks)."""
        parts = []
        for u in us:
            router, sg, g, up = self._project(u, False)
            shared = self.shared_expert(u, False, (g, up))
            w, ids = route(router, self.top_k, self.norm_topk, False)
            parts.append((shared, sg, w, ids))
        ex = self.experts
        routed = experts_of_chunks(us, [p[2] for p in parts], [p[3] for p in parts], ex.gate_up, ex.down)
        return [sigmoid_gate(sh, sg, r, False) for (sh, sg, _, _), r in zip(parts, routed, strict=True)]

    def _project(self, u: torch.Tensor, ri: bool) -> tuple[torch.Tensor, ...]:
        """(router logits, shared-expert gate, shared gate, shared up) of u [T, H]."""
        if ri or self.in_proj is not None or self.router_proj is None:
            return project(u, self._parts(), self.in_proj, ri)
        # NOTE: FP8 prefill: the router and sg through their stack, not sg as a GEMM of one column
        se = self.shared_expert
        router_sg = project(u, (self.gate, self.shared_expert_gate), self.router_proj, ri)
        return (*router_sg, *project(u, (se.gate_proj, se.up_proj), self.shared_gate_up, ri))

    def _decode(self, u: torch.Tensor, router, shared_gate_up) -> torch.Tensor:
        """Row-invariant rows (decode, verify windows) of a fused model (`fuse`) whose shared expert has
        the routed experts' width (Flash-Next: 640 both): it runs as one more routed expert (id E,
        weight sigmoid(sg), added last: the same roundings as sigmoid_gate), so its projections ride the
        grouped expert kernels instead of a GEMV, an activation and a gate of their own."""
        if isinstance(router, Fp8Weight):  # (an FP8 router: its stack pads the router's rows)
            logits = torch.cat(project(u, (self.gate, self.shared_expert_gate), router, True), dim=-1)
        else:
            logits = linear(u, router, True)  # [T, E + 1]: the router's logits, then sg
        w, ids = route(logits, self.top_k, self.norm_topk, True, shared=True)  # [T, k + 1]
        ex, se = self.experts, self.shared_expert
        return experts(u, w, ids, ex.gate_up, ex.down, True, (shared_gate_up, se.down_proj.operand))
