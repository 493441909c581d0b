"""Fused recurrent gated delta rule over a chunk of T tokens of one sequence (prefill) for CUDA.

Reference: `nextserve.ops.gdn.gated_delta_rule` on the CPU, the token-by-token torch loop.

# NOTE: one program per (value head, dv tile), one launch per chunk. The program loads its [dk, BLOCK_V]
# float32 state tile once, keeps it in registers while it loops t = 0..T-1 (each step is `gdn_token`, the
# decode kernel's own per-token code: L2-normalise q, k of key head h // (Hv/Hk) in float32, S <- e^g S;
# S += k (beta (v - S^T k))^T; o = S^T q), stores o_t every step and the final tile once at the end into
# a new state tensor (the input state is only read). The next token's q, k, v, g, beta are loaded before
# the current step runs, so their latency hides behind its arithmetic; that moves loads, never math.
# Tile sizes and the warp count are the decode kernel's (ops/triton/gdn_step.py: whole dk, BLOCK_V of dv,
# NUM_WARPS), so the reductions run in the same order and a token of a prefill chunk gets the bits of
# the same token run through T successive one-token decode steps (a float32 state is stored and reloaded
# exactly between decode steps). No atomics: each program owns its tile, so the output is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start
from .gdn_step import BLOCK_V, EPS, NUM_WARPS, gdn_token


@triton.jit
def _gdn_chunk(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, new_state_ptr,
    T, DK, DV, scale, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_betat,
    stride_sh, stride_sk, stride_sv, stride_ot, stride_oh, stride_nh, stride_nk, stride_nv,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    h = tl.program_id(0)
    hk = h // GROUP
    rk = tl.arange(0, BLOCK_K)
    rv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = rk < DK
    mv = rv < DV
    smask = mk[:, None] & mv[None, :]
    S = tl.load(
        state_ptr + h * stride_sh + rk[:, None] * stride_sk + rv[None, :] * stride_sv, mask=smask, other=0.0
    ).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    # pointers advance by one token per step (64-bit pointer arithmetic, whatever T * stride is)
    q_ptrs = q_ptr + hk * stride_qh + rk
    k_ptrs = k_ptr + hk * stride_kh + rk
    v_ptrs = v_ptr + h * stride_vh + rv
    g_ptrs = g_ptr + h
    beta_ptrs = beta_ptr + h
    o_ptrs = o_ptr + h * stride_oh + rv
    q = tl.load(q_ptrs, mask=mk, other=0.0)
    k = tl.load(k_ptrs, mask=mk, other=0.0)
    v = tl.load(v_ptrs, mask=mv, other=0.0)
    g = tl.load(g_ptrs)
    beta = tl.load(beta_ptrs)
    for _ in range(0, T - 1):
        # prefetch token t + 1, then run token t
        q_ptrs += stride_qt
        k_ptrs += stride_kt
        v_ptrs += stride_vt
        g_ptrs += stride_gt
        beta_ptrs += stride_betat
        q_next = tl.load(q_ptrs, mask=mk, other=0.0)
        k_next = tl.load(k_ptrs, mask=mk, other=0.0)
        v_next = tl.load(v_ptrs, mask=mv, other=0.0)
        g_next = tl.load(g_ptrs)
        beta_next = tl.load(beta_ptrs)
        o, S = gdn_token(q, k, v, g, beta, S, scale, eps)
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mv)
        o_ptrs += stride_ot
        q, k, v, g, beta = q_next, k_next, v_next, g_next, beta_next
    o, S = gdn_token(q, k, v, g, beta, S, scale, eps)  # the last token (T >= 1), nothing to prefetch
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mv)
    n_ptrs = new_state_ptr + h * stride_nh + rk[:, None] * stride_nk + rv[None, :] * stride_nv
    tl.store(n_ptrs, S, mask=smask)


def triton_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv]; state [Hv, dk, dv] (read only).

    Returns (o [T, Hv, dv] in v.dtype, new state [Hv, dk, dv] float32), as `ops.gdn.gated_delta_rule`.
    One launch, no host reads; any strides (the last dim of q, k, v is made contiguous if it is not)."""
    T, Hk, dk = k.shape
    Hv, dv = v.shape[1], v.shape[2]
    assert q.shape == k.shape and v.shape[0] == T and Hv % Hk == 0, (q.shape, k.shape, v.shape)
    assert g.shape == (T, Hv) and beta.shape == (T, Hv), (g.shape, beta.shape)
    assert state.shape == (Hv, dk, dv), state.shape
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    g, beta = (t if t.stride(-1) == 1 else t.contiguous() for t in (g, beta))
    state = state if state.dtype == torch.float32 else state.float()
    o = torch.empty((T, Hv, dv), dtype=v.dtype, device=v.device)
    new_state = torch.empty((Hv, dk, dv), dtype=torch.float32, device=v.device)
    if T == 0:
        new_state.copy_(state)
        return o, new_state
    block_v = min(BLOCK_V, triton.next_power_of_2(dv))
    grid = (Hv, triton.cdiv(dv, block_v))
    _gdn_chunk[grid](
        q, k, v, g, beta, state, o, new_state,
        T, dk, dv, dk**-0.5, EPS,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        beta.stride(0),
        state.stride(0), state.stride(1), state.stride(2), o.stride(0), o.stride(1),
        new_state.stride(0), new_state.stride(1), new_state.stride(2),
        GROUP=Hv // Hk, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, num_warps=NUM_WARPS,
        **pdl_args(q),
    )  # fmt: skip
    return o, new_state
