"""Row-invariant routed experts of decode rows (MoE) for CUDA: two Triton kernels, no host reads.

Reference: `_experts_by_row` in nextserve/ops/moe.py (per row, its experts in ascending id order).

# NOTE: each row's work is done by programs of its own, with a tiling fixed by the block sizes alone,
# never by M: kernel 1 has one program per (row, routing slot, I tile), kernel 2 one per (row, H tile),
# and a program reads nothing of another row. Every dot is a tl.sum per fixed K tile, added to a
# float32 accumulator tile after tile in order (plain GEMVs, no tl.dot: with one useful row per
# (row, expert) an MMA would waste 15 of its 16 rows). The k expert contributions are added one at a
# time in ascending (expert id, slot) order, chosen on the device by a running minimum over the row's
# keys, so the order never depends on how the router listed them; no atomics. One compiled kernel
# serves every M (M is not an argument, so Triton never specialises on it): a row's bits are the same
# whatever rows run beside it (C1), and the launch has fixed shapes, so it can be captured in a CUDA
# graph.
# NOTE: default blocks, for M=1 at the real sizes (H=2560, I=640, k=10) on an H200 (132 SMs): kernel 1
# has 10 * 640/16 = 400 programs and kernel 2 2560/8 = 320, each resident at once (about 80 and 140
# registers a thread, 4 warps: 6 and 3 programs an SM), so no second partial wave, with 16-20 KB of
# weight loads in flight per program. The benchmark (benchmarks/bench_kernels.py moe_decode) sweeps them.
# NOTE: the roundings follow the reference: gate and up rounded to the model dtype (as F.linear's
# output is), silu and the product rounded to it, y = down·act rounded to it, then
# acc = acc + (y * w) with each step rounded to it. Only the order inside each dot differs
# (float32 accumulation), so outputs match the reference to a tolerance, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start


@triton.jit
def _gate_up_act(
    x_ptr, ids_ptr, gu_ptr, act_ptr, H, I,
    stride_gu_e, stride_gu_n,
    K_TOP: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """act[r, s, i] = silu(gate_e[i]·x_r) * (up_e[i]·x_r), e = ids[r, s]; program (r*k + s, I tile)."""
    pdl_start(PDL)
    pid_rs = tl.program_id(0)
    pid_i = tl.program_id(1)
    r = pid_rs // K_TOP
    e = tl.load(ids_ptr + pid_rs).to(tl.int64)
    ri = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = ri < I
    g_rows = gu_ptr + e * stride_gu_e + ri.to(tl.int64) * stride_gu_n
    u_rows = g_rows + I * stride_gu_n
    # NOTE: the tile is reduced each K step into [BLOCK_I] accumulators rather than kept as a
    # [BLOCK_I, BLOCK_K] float32 accumulator: the registers go to loads in flight (more resident
    # programs), which is what a weight-streaming GEMV at M=1 is bound by.
    acc_g = tl.zeros((BLOCK_I,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_I,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask_k = rk < H
        xk = tl.load(x_ptr + r.to(tl.int64) * H + rk, mask=mask_k, other=0.0).to(tl.float32)
        m2 = mask_i[:, None] & mask_k[None, :]
        wg = tl.load(g_rows[:, None] + rk[None, :], mask=m2, other=0.0).to(tl.float32)
        wu = tl.load(u_rows[:, None] + rk[None, :], mask=m2, other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * xk[None, :], axis=1)
        acc_u += tl.sum(wu * xk[None, :], axis=1)
    dt = act_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    act = (silu * u).to(dt)
    tl.store(act_ptr + pid_rs.to(tl.int64) * I + ri, act, mask=mask_i)


@triton.jit
def _down_combine(
    act_ptr, ids_ptr, w_ptr, down_ptr, out_ptr, H, I,
    stride_d_e, stride_d_h,
    K_TOP: tl.constexpr, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """out[r, h] = sum over the row's experts in ascending id of w * (down_e[h]·act[r, s]); program
    (r, H tile), all k experts of the row at once as a [K_PAD, BLOCK_H, BLOCK_I] tile per I step."""
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    rs = tl.arange(0, K_PAD)
    mask_s = rs < K_TOP
    e = tl.load(ids_ptr + r * K_TOP + rs, mask=mask_s, other=0).to(tl.int64)
    rh = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = rh < H
    rows = down_ptr + e[:, None] * stride_d_e + rh[None, :].to(tl.int64) * stride_d_h  # [K_PAD, BLOCK_H]
    mask_sh = mask_s[:, None] & mask_h[None, :]
    acc = tl.zeros((K_PAD, BLOCK_H), dtype=tl.float32)
    for i0 in range(0, I, BLOCK_I):
        ri = i0 + tl.arange(0, BLOCK_I)
        mask_i = ri < I
        a = tl.load(
            act_ptr + (r * K_TOP + rs[:, None]) * I + ri[None, :],
            mask=mask_s[:, None] & mask_i[None, :],
            other=0.0,
        ).to(tl.float32)
        wd = tl.load(
            rows[:, :, None] + ri[None, None, :],
            mask=mask_sh[:, :, None] & mask_i[None, None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(wd * a[:, None, :], axis=2)
    dt = out_ptr.dtype.element_ty
    wt = tl.load(w_ptr + r * K_TOP + rs, mask=mask_s, other=0.0).to(tl.float32)
    yw = (acc.to(dt).to(tl.float32) * wt[:, None]).to(dt).to(tl.float32)  # [K_PAD, BLOCK_H]
    # NOTE: ascending (expert id, slot), as the reference's stable sort by id; each pick is an exact
    # select (one nonzero in the sum), and each add is rounded to the model dtype as the reference's is.
    keys = tl.where(mask_s, e * K_PAD + rs, 9223372036854775807)
    out = tl.zeros((BLOCK_H,), dtype=tl.float32)
    prev = tl.min(keys) - 1
    for _ in tl.static_range(K_TOP):
        cur = tl.min(tl.where(keys > prev, keys, 9223372036854775807))
        pick = tl.sum(tl.where((keys == cur)[:, None], yw, 0.0), axis=0)
        out = (out + pick).to(dt).to(tl.float32)
        prev = cur
    tl.store(out_ptr + r * H + rh, out.to(dt), mask=mask_h)


def expert_shapes(x, weights, ids, gate_up, down) -> tuple[int, int, int, int]:
    """(M, H, k, I) of an experts call, after checking the shapes the kernels assume: x [M, H],
    weights and ids [M, k], gate_up [E, 2I, H] and down [E, H, I] (plain ones with unit stride on the last
    dim)."""
    M, H = x.shape
    k = ids.shape[1]
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    assert gate_up.shape == (E, 2 * I, H) and down.shape == (E, H, I), (gate_up.shape, down.shape)
    assert weights.shape == ids.shape == (M, k), (weights.shape, ids.shape)
    # (FP8 and int4 weights: their kernels' arguments are made unit-stride)
    assert all(w.stride(-1) == 1 for w in (gate_up, down) if isinstance(w, torch.Tensor))
    return M, H, k, I


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    block_i: int = 8,
    block_k: int = 512,
    block_h: int = 8,
    block_i_down: int = 128,
    warps_gate_up: int = 4,
    warps_down: int = 4,
) -> torch.Tensor:
    """x [M, H]; weights [M, k] (x.dtype); ids [M, k] int64; gate_up [E, 2I, H]; down [E, H, I].
    Returns [M, H] in x.dtype: per row, sum over its k experts taken in ascending expert id of
    w * down(silu(gate·x) * (up·x)).

    Row-invariant and free of host reads (CUDA-graph capturable). The block sizes are part of the
    numerics: a row's bits are fixed for given blocks, whatever M. Ids within a row are expected to be
    distinct (top-k); a repeated id is still summed, in slot order, as the reference does."""
    M, H, k, I = expert_shapes(x, weights, ids, gate_up, down)
    out = torch.empty((M, H), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    x = x.contiguous()
    ids = ids.contiguous()
    weights = weights.contiguous()
    act = torch.empty((M, k, I), dtype=x.dtype, device=x.device)
    _gate_up_act[(M * k, triton.cdiv(I, block_i))](
        x, ids, gate_up, act, H, I, gate_up.stride(0), gate_up.stride(1),
        K_TOP=k, BLOCK_I=block_i, BLOCK_K=block_k, num_warps=warps_gate_up, **pdl_args(x),
    )  # fmt: skip
    _down_combine[(M, triton.cdiv(H, block_h))](
        act, ids, weights, down, out, H, I, down.stride(0), down.stride(1),
        K_TOP=k, K_PAD=triton.next_power_of_2(k), BLOCK_H=block_h, BLOCK_I=block_i_down,
        num_warps=warps_down, **pdl_args(act),
    )  # fmt: skip
    return out
