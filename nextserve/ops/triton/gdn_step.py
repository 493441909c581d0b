"""Batched decode step of the gated delta rule (one token per row, state by slot) for CUDA.

Reference: `nextserve.ops.gdn.recurrent_step` on the CPU, a per-row loop over `gated_delta_rule`.

# NOTE: one program per (row, value head, dv tile): it L2-normalises its row's q and k (of key head
# h // (Hv/Hk)) in float32, loads its slot's [dk, BLOCK_V] state tile (the slot found through `slots` on
# the device, so nothing is read to the host and the launch can be captured in a CUDA graph), runs one
# step S <- e^g S; S += k (beta (v - S^T k))^T; o = S^T q, and stores the tile back in place. The
# reductions run over dk inside the program; the tile sizes (whole dk, BLOCK_V of dv) and the warp count
# depend on the head sizes only, never on the row count, which only sizes the grid. So a row's output
# and its slot's new state are the same bits whatever rows are beside it and however many there are
# (C1) - by construction. Slots are distinct, so no two programs touch the same state tile.
# The per-token arithmetic is `gdn_token`, shared with the prefill kernel (ops/triton/gdn_chunk.py), which
# runs it for every token of a chunk with the same tile sizes and warp count, so a token gets the same
# bits from a prefill chunk as from this decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start

BLOCK_V = 32
NUM_WARPS = 4
EPS = 1e-6  # as ops.norms.l2_norm


@triton.jit
def gdn_token(q, k, v, g, beta, S, scale, eps):
    """One token of the gated delta rule on one program's state tile, all in float32: q, k [BLOCK_K] (raw,
    L2-normalised here, q scaled), v [BLOCK_V], g, beta scalars, S [BLOCK_K, BLOCK_V] float32.
    Returns (o [BLOCK_V] float32, new S). Masked lanes must come in as zeros (they stay zeros)."""
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    v = v.to(tl.float32)
    g = g.to(tl.float32)
    beta = beta.to(tl.float32)
    S = S * tl.exp(g)
    kv_mem = tl.sum(S * k[:, None], axis=0)  # [BLOCK_V]
    delta = (v - kv_mem) * beta
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], axis=0)
    return o, S


@triton.jit
def _gdn_step(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, o_ptr,
    DK, DV, scale, eps,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_betab,
    stride_ss, stride_sh, stride_sk, stride_sv, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    rk = tl.arange(0, BLOCK_K)
    rv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = rk < DK
    mv = rv < DV
    q = tl.load(q_ptr + b * stride_qb + hk * stride_qh + rk, mask=mk, other=0.0)
    k = tl.load(k_ptr + b * stride_kb + hk * stride_kh + rk, mask=mk, other=0.0)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + rv, mask=mv, other=0.0)
    g = tl.load(g_ptr + b * stride_gb + h)
    beta = tl.load(beta_ptr + b * stride_betab + h)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + rk[:, None] * stride_sk + rv[None, :] * stride_sv
    smask = mk[:, None] & mv[None, :]
    S = tl.load(s_ptrs, mask=smask, other=0.0)  # [BLOCK_K, BLOCK_V] float32
    o, S = gdn_token(q, k, v, g, beta, S, scale, eps)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + rv, o.to(o_ptr.dtype.element_ty), mask=mv)
    tl.debug_barrier()  # NOTE: every load of the tile is done before it is overwritten in place
    tl.store(s_ptrs, S, mask=smask)


def triton_recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """q, k [B, Hk, dk]; v [B, Hv, dv]; g, beta [B, Hv]; state [S, Hv, dk, dv] float32, updated in place
    at rows `slots` [B] (distinct). Returns o [B, Hv, dv] in v.dtype. One launch, no host reads."""
    B, Hk, dk = k.shape
    Hv, dv = v.shape[1], v.shape[2]
    assert q.shape == k.shape and Hv % Hk == 0, (q.shape, k.shape, v.shape)
    assert state.dtype == torch.float32 and state.shape[1:] == (Hv, dk, dv), (state.dtype, state.shape)
    q, k, v, g, beta = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty((B, Hv, dv), dtype=v.dtype, device=v.device)
    if B == 0:
        return o
    block_v = min(BLOCK_V, triton.next_power_of_2(dv))
    grid = (B, Hv, triton.cdiv(dv, block_v))
    _gdn_step[grid](
        q, k, v, g, beta, state, slots, o,
        dk, dv, dk**-0.5, EPS,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        beta.stride(0),
        state.stride(0), state.stride(1), state.stride(2), state.stride(3), o.stride(0), o.stride(1),
        GROUP=Hv // Hk, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, num_warps=NUM_WARPS,
        **pdl_args(q),
    )  # fmt: skip
    return o
