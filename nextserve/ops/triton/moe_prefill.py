"""Routed experts of a prefill chunk (MoE) for CUDA: a deterministic grouped GEMM in Triton.

Reference: the non-row-invariant path of `experts` in nextserve/ops/moe.py (per expert in ascending
id: h = x[tok] @ gate_up[e]^T, act = silu(g) * u, y = act @ down[e]^T, out[tok] += y * w).

# NOTE: the design is vLLM's fused_moe without its atomics. The T*k (token, slot) pairs are sorted by
# expert (torch.sort, stable: ties in pair order), and a one-kernel plan cuts each expert's run of
# sorted pairs into blocks of at most BLOCK_M pairs of that expert: block b gets (expert, lo, hi) over
# the sorted list. The number of blocks is bounded without reading the routing on the host,
# sum_e cdiv(c_e, BLOCK_M) <= (n + min(E, n) * (BLOCK_M - 1)) // BLOCK_M for n = T*k pairs, so
# every launch has a grid fixed by (T, k, E, BLOCK_M) alone and the blocks past the last one exit at
# once: no host reads, no per-expert syncs, and the call can be captured in a CUDA graph.
#   1. `_grouped_gate_up`, program (block, I tile): a [BLOCK_M, H] gather of x rows times the
#      expert's gate and up tiles (two tl.dot, float32 accumulators), then silu(g) * u, written to act
#      [n, I] at the pairs' sorted positions (so kernel 2 reads contiguous rows).
#   2. `_grouped_down`, program (block, H tile): act rows times the expert's down tile (tl.dot), then
#      y * w, written to yw [n, H] at the pair's own index t*k + s.
#   3. `_combine`, program (token, H tile): the token's k rows of yw summed one at a time in ascending
#      (expert id, slot) order, chosen on the device by a running minimum as in moe_decode.py.
# Every output element is written by one program, with a reduction order fixed by the block sizes:
# two calls on equal inputs give equal bits (no atomics anywhere). The block sizes (BLOCK_M included)
# are part of the numerics; the default BLOCK_M depends on the pairs per expert, so on T.
# NOTE: the roundings follow the reference: gate and up rounded to the model dtype (as F.linear's
# output is), silu and the product rounded to it, y rounded to it, y * w rounded to it, then
# out = out + y * w rounded to it after each expert. Only the order inside each dot differs (float32
# accumulation, as cuBLAS's), so outputs match the reference to a tolerance, not bit for bit. float32
# inputs use IEEE dots (no TF32), as torch's matmul does by default.
# NOTE: at the real sizes (H=2560, I=640, E=512, k=10) a chunk of 64 tokens or more touches most of
# the 512 experts, whose weights are 5 GB of bf16 a layer: the call is bound by reading each active
# expert's weights once (about 1 ms on an H200), so the blocks aim at streaming weight tiles with
# several loads in flight; a smaller BLOCK_M only saves MMA work on the mostly empty blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lower_bound(sorted_ptr, n, v, SEARCH_STEPS):
    """For each value of v: the first index i in [0, n) with sorted[i] >= v (n if none)."""
    lo = tl.zeros_like(v)
    hi = tl.zeros_like(v) + n
    for _ in range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        s = tl.load(sorted_ptr + mid, mask=active, other=0)
        below = s < v
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & (s >= v), mid, hi)
    return lo


@triton.jit
def _plan(
    sorted_e_ptr, blk_e_ptr, blk_lo_ptr, blk_hi_ptr, n, E, NB_MAX, SEARCH_STEPS,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Blocks CHUNK*pid.. of the plan: block b -> (expert or -1, lo, hi) over the sorted pairs. Each
    program finds every expert's run [start, end) by binary search, then its blocks by comparisons."""
    e = tl.arange(0, E_PAD)
    start = _lower_bound(sorted_e_ptr, n, e, SEARCH_STEPS)
    end = _lower_bound(sorted_e_ptr, n, e + 1, SEARCH_STEPS)
    nb = tl.where(e < E, (end - start + BLOCK_M - 1) // BLOCK_M, 0)
    cum = tl.cumsum(nb, 0)  # inclusive: expert e's blocks are [cum - nb, cum)
    b = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    eb = tl.sum((cum[None, :] <= b[:, None]).to(tl.int32), axis=1)  # [CHUNK] the expert of block b
    hit = e[None, :] == eb[:, None]  # [CHUNK, E_PAD], one hit a row (none past the last block)
    first = tl.sum(tl.where(hit, cum - nb, 0), axis=1)
    lo = tl.sum(tl.where(hit, start, 0), axis=1) + (b - first) * BLOCK_M
    hi = tl.minimum(lo + BLOCK_M, tl.sum(tl.where(hit, end, 0), axis=1))
    valid = eb < E
    mask_b = b < NB_MAX
    tl.store(blk_e_ptr + b, tl.where(valid, eb, -1), mask=mask_b)
    tl.store(blk_lo_ptr + b, tl.where(valid, lo, 0), mask=mask_b)
    tl.store(blk_hi_ptr + b, tl.where(valid, hi, 0), mask=mask_b)


@triton.jit
def _grouped_gate_up(
    x_ptr, order_ptr, blk_e_ptr, blk_lo_ptr, blk_hi_ptr, gu_ptr, act_ptr, H, I,
    stride_x, stride_gu_e, stride_gu_n,
    K_TOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """act[p] = silu(gate_e · x[tok]) * (up_e · x[tok]) for the block's sorted pairs p (of expert e);
    program (block, I tile)."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(blk_e_ptr + pid_b)
    if e < 0:
        return
    lo = tl.load(blk_lo_ptr + pid_b)
    hi = tl.load(blk_hi_ptr + pid_b)
    rows = lo + tl.arange(0, BLOCK_M)
    mask_m = rows < hi
    # NOTE: rows past the block's end read the block's last pair (a valid address, no load mask on the
    # gather) and are never stored.
    pair = tl.load(order_ptr + tl.minimum(rows, hi - 1))
    tok = (pair // K_TOP).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < I
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_x + rk[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = gu_ptr + e.to(tl.int64) * stride_gu_e + rn[None, :] * stride_gu_n + rk[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + I * stride_gu_n
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            if EVEN_N:
                wg = tl.load(g_ptrs)
                wu = tl.load(u_ptrs)
            else:
                wg = tl.load(g_ptrs, mask=mask_n[None, :], other=0.0)
                wu = tl.load(u_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = (k0 + rk) < H
            a = tl.load(a_ptrs, mask=mask_k[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dt = act_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    act = (silu * u).to(dt)
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(act_ptr + rows[:, None].to(tl.int64) * I + rn[None, :], act, mask=mask)


@triton.jit
def _grouped_down(
    act_ptr, order_ptr, w_ptr, blk_e_ptr, blk_lo_ptr, blk_hi_ptr, down_ptr, yw_ptr, H, I,
    stride_d_e, stride_d_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """yw[pair] = w[pair] * (down_e · act[p]) for the block's sorted pairs p; program (block, H tile)."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(blk_e_ptr + pid_b)
    if e < 0:
        return
    lo = tl.load(blk_lo_ptr + pid_b)
    hi = tl.load(blk_hi_ptr + pid_b)
    rows = lo + tl.arange(0, BLOCK_M)
    mask_m = rows < hi
    rows_c = tl.minimum(rows, hi - 1).to(tl.int64)  # rows past the end re-read the last one
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < H
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows_c[:, None] * I + rk[None, :]  # [BLOCK_M, BLOCK_K]
    d_ptrs = down_ptr + e.to(tl.int64) * stride_d_e + rn[None, :] * stride_d_h + rk[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            if EVEN_N:
                wd = tl.load(d_ptrs)
            else:
                wd = tl.load(d_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = (k0 + rk) < I
            a = tl.load(a_ptrs, mask=mask_k[None, :], other=0.0)
            wd = tl.load(d_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, wd, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        d_ptrs += BLOCK_K
    dt = yw_ptr.dtype.element_ty
    pair = tl.load(order_ptr + rows_c).to(tl.int64)
    wt = tl.load(w_ptr + pair).to(tl.float32)
    yw = (acc.to(dt).to(tl.float32) * wt[:, None]).to(dt)
    tl.store(yw_ptr + pair[:, None] * H + rn[None, :], yw, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _combine(
    yw_ptr, ids_ptr, out_ptr, H,
    K_TOP: tl.constexpr, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """out[t] = the token's k rows of yw added one at a time in ascending (expert id, slot), each add
    rounded to the model dtype; program (token, H tile)."""
    t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    rs = tl.arange(0, K_PAD)
    mask_s = rs < K_TOP
    e = tl.load(ids_ptr + t * K_TOP + rs, mask=mask_s, other=0).to(tl.int64)
    keys = tl.where(mask_s, e * K_PAD + rs, 9223372036854775807)
    rh = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = rh < H
    dt = out_ptr.dtype.element_ty
    out = tl.zeros((BLOCK_H,), dtype=tl.float32)
    prev = tl.min(keys) - 1
    for _ in tl.static_range(K_TOP):
        cur = tl.min(tl.where(keys > prev, keys, 9223372036854775807))
        s = cur % K_PAD
        y = tl.load(yw_ptr + (t * K_TOP + s) * H + rh, mask=mask_h, other=0.0).to(tl.float32)
        out = (out + y).to(dt).to(tl.float32)
        prev = cur
    tl.store(out_ptr + t * H + rh, out.to(dt), mask=mask_h)


def default_block_m(pairs: int, num_experts: int) -> int:
    """BLOCK_M for n pairs over E experts: about the mean pairs per expert, 16 to 64 (the MMA rows of a
    mostly empty block are wasted; an expert with more pairs than BLOCK_M is cut into more blocks)."""
    mean = pairs / max(num_experts, 1)
    return 16 if mean <= 8 else 32 if mean <= 24 else 64


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    block_n_down: int = 128,
    block_k_down: int = 64,
    warps: int = 4,
    warps_down: int = 4,
    stages: int = 4,
    stages_down: int = 4,
    block_h_combine: int = 512,
) -> torch.Tensor:
    """x [T, H]; weights [T, k]; ids [T, k] (int32/int64, < E); gate_up [E, 2I, H] (gate rows first);
    down [E, H, I]. Returns [T, H] in x.dtype: per token, sum over its k experts taken in ascending
    expert id of w * down(silu(gate·x) * (up·x)).

    Deterministic (no atomics) and free of host reads. block_m None picks it from T*k/E
    (`default_block_m`); the block sizes are part of the numerics. A repeated id in a row is still
    summed, in slot order, as the reference does."""
    T, H = x.shape
    k = ids.shape[1]
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    assert gate_up.shape == (E, 2 * I, H) and down.shape == (E, H, I), (gate_up.shape, down.shape)
    assert weights.shape == ids.shape == (T, k), (weights.shape, ids.shape)
    assert gate_up.stride(-1) == 1 and down.stride(-1) == 1
    n = T * k
    if n == 0:
        return torch.zeros_like(x)
    dev = x.device
    x = x.contiguous()
    ids = ids.contiguous()
    weights = weights.contiguous()
    bm = block_m or default_block_m(n, E)
    sorted_e, order = torch.sort(ids.reshape(-1), stable=True)
    # NOTE: sum_e cdiv(c_e, bm) <= (n + active * (bm - 1)) // bm, with at most min(E, n) experts active.
    nb_max = (n + min(E, n) * (bm - 1)) // bm
    blk = torch.empty((3, nb_max), dtype=torch.int32, device=dev)
    chunk = 32
    _plan[(triton.cdiv(nb_max, chunk),)](
        sorted_e, blk[0], blk[1], blk[2], n, E, nb_max, n.bit_length() + 1,
        BLOCK_M=bm, E_PAD=triton.next_power_of_2(E), CHUNK=chunk,
    )  # fmt: skip
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty((n, I), dtype=x.dtype, device=dev)
    _grouped_gate_up[(nb_max, triton.cdiv(I, block_n))](
        x, order, blk[0], blk[1], blk[2], gate_up, act, H, I,
        x.stride(0), gate_up.stride(0), gate_up.stride(1),
        K_TOP=k, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=H % block_k == 0, EVEN_N=I % block_n == 0, DOT_PRECISION=precision,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    yw = torch.empty((n, H), dtype=x.dtype, device=dev)
    _grouped_down[(nb_max, triton.cdiv(H, block_n_down))](
        act, order, weights, blk[0], blk[1], blk[2], down, yw, H, I,
        down.stride(0), down.stride(1),
        BLOCK_M=bm, BLOCK_N=block_n_down, BLOCK_K=block_k_down,
        EVEN_K=I % block_k_down == 0, EVEN_N=H % block_n_down == 0, DOT_PRECISION=precision,
        num_warps=warps_down, num_stages=stages_down,
    )  # fmt: skip
    out = torch.empty_like(x)
    _combine[(T, triton.cdiv(H, block_h_combine))](
        yw, ids, out, H, K_TOP=k, K_PAD=triton.next_power_of_2(k), BLOCK_H=block_h_combine,
    )  # fmt: skip
    return out
