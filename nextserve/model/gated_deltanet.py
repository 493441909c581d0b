"""Gated DeltaNet linear-attention block."""

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.conv import conv_chunk, conv_step, conv_window
from ..ops.fp8 import Fp8Weight
from ..ops.gdn import gated_delta_rule, gdn_gates, recurrent_step, recurrent_window
from ..ops.linear import linear
from ..ops.norms import rms_norm_gated
from .batch import DecodeBatch, ForwardBatch, WindowBatch, cat_rows
from .params import Projection, Weight, fuse_rows, project


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, gdn_index: int) -> None:
        super().__init__()
        self.gdn_index = gdn_index
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.eps, self.gate_act = cfg.rms_norm_eps, cfg.output_gate
        self.conv_parts = (self.hk * self.dk, self.hk * self.dk, self.hv * self.dv)  # q | k | v
        H, conv_dim, vdim = cfg.hidden_size, cfg.gdn_conv_dim, self.hv * self.dv
        self.in_proj_qkv = Projection(conv_dim, H)
        self.in_proj_z = Projection(vdim, H)
        self.in_proj_b = Projection(self.hv, H)
        self.in_proj_a = Projection(self.hv, H)
        self.conv1d = Weight(conv_dim, 1, cfg.linear_conv_kernel_dim)
        self.A_log = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.norm = Weight(self.dv)
        self.out_proj = Projection(H, vdim)
        self.in_proj: torch.Tensor | Fp8Weight | None = None  # qkv|z|b|a stacked by fuse()

    def _in_parts(self) -> tuple[Projection, ...]:
        return (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def fuse(self) -> None:
        self.in_proj = fuse_rows(*self._in_parts())

    def _project(self, u: torch.Tensor, ri: bool):
        """u [T, H] -> (qkv [T, conv_dim], z [T, Hv, dv], g [T, Hv] float32, beta [T, Hv])."""
        T = u.shape[0]
        qkv, z, b, a = project(u, self._in_parts(), self.in_proj, ri)
        g, beta = gdn_gates(b, a, self.A_log, self.dt_bias, ri)
        return qkv, z.reshape(T, self.hv, self.dv), g, beta

    def _split(self, x: torch.Tensor | list[torch.Tensor]):
        """Conv output [T, conv_dim] (or its q, k, v column parts) -> q, k [T, Hk, dk], v [T, Hv, dv]."""
        q, k, v = x if isinstance(x, list) else x.split(self.conv_parts, dim=-1)
        T = q.shape[0]
        return q.reshape(T, self.hk, self.dk), k.reshape(T, self.hk, self.dk), v.reshape(T, self.hv, self.dv)

    def _output(self, o: torch.Tensor, z: torch.Tensor, ri: bool) -> torch.Tensor:
        """o [T, Hv, dv] -> [T, H]."""
        o = rms_norm_gated(o, z, self.norm.weight, self.eps, self.gate_act, ri)
        return linear(o.reshape(o.shape[0], self.hv * self.dv), self.out_proj.operand, ri)

    def forward(self, u: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        ri = batch.row_invariant
        qkv, z, g, beta = self._project(u, ri)
        conv_w = self.conv1d.weight[:, 0, :]  # [C, K]
        core = []
        for chunk, (s, e) in zip(batch.chunks, batch.spans(), strict=True):
            conv_hist, rec = chunk.cache.gdn_state(self.gdn_index)
            if ri:  # a verify window: decode's conv, token by token (C1)
                x = conv_window(qkv[s:e], conv_hist, conv_w, silu=True)
            else:  # q, k, v each contiguous, as fla's kernels read them
                x, new_hist = conv_chunk(qkv[s:e], conv_hist, conv_w, silu=True, parts=self.conv_parts)
                conv_hist.copy_(new_hist)
            q, k, v = self._split(x)
            if ri:  # a verify window: decode's recurrence kernel, token by token (C1)
                core.append(recurrent_window(q, k, v, g[s:e], beta[s:e], rec))
                continue
            o, new_rec = gated_delta_rule(q, k, v, g[s:e], beta[s:e], rec)
            rec.copy_(new_rec)
            core.append(o)
        return self._output(cat_rows(core), z, ri)  # core [T, Hv, dv]

    def decode(self, u: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """One token per row, state read and written through the rows' slots."""
        return self.window(u, WindowBatch.of(batch))

    def window(self, u: torch.Tensor, batch: WindowBatch) -> torch.Tensor:
        """W decode steps' rows [W*B, H]: the projections on all rows, the conv and the recurrence step
        by step on the rows' slots (each step's state kept for a rewind)."""
        qkv, z, g, beta = self._project(u, True)
        conv_w = self.conv1d.weight[:, 0, :]
        core = []
        for rows, step in batch.rows():
            conv, rec = step.cache.gdn_planes(self.gdn_index)
            slots = step.cache.slots
            q, k, v = self._split(conv_step(qkv[rows], conv, slots, conv_w, silu=True))
            core.append(recurrent_step(q, k, v, g[rows], beta[rows], rec, slots))
            step.cache.keep_state(conv, rec)
        return self._output(cat_rows(core), z, True)
