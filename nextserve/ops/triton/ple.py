"""PLE kernels for CUDA: a decode step's n-gram context, hash and context update in one launch, and the
key-query gate of the embedded value into the streams in one launch (each replacing ~a dozen torch ops).

References (the CPU paths): `ple_decode_ids` and `ple_gate` in nextserve/ops/ple.py.

# NOTE: one program per row (ids) or per (row, stream) (gate); block sizes and warp counts are constants
# (the gate's block depends on H alone) and the row count only sizes the grid, so a row's bits never
# depend on the rows beside it (C1). Nothing is read to the host: slots, token ids, multipliers, primes
# and offsets are read on the device, so both launches can be captured in a CUDA graph.
# The ids are exact: int64 products wrap around as torch's do, and the C-style `%` (sign of the
# dividend) is corrected to torch.remainder's floor remainder. The gate follows the reference's dtype
# semantics: each op in float32, rounded to the model dtype where torch rounds; the dot over H is one
# fixed-order float32 reduction (a BLOCK-wide accumulator over H's blocks, then tl.sum), rounded once,
# as torch's reduction in the model dtype is (its summation order differs: equal up to rounding).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start, sigmoid, unit_stride

BLOCK = 1024
NUM_WARPS = 4


@triton.jit(do_not_specialize=["eos"])
def _decode_ids(
    ctx_ptr, slots_ptr, tok_ptr, mult_ptr, sizes_ptr, offs_ptr, out_ptr, eos, stride_cs, stride_cc,
    N: tl.constexpr, PER_ORDER: tl.constexpr, HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    row = ctx_ptr + tl.load(slots_ptr + b).to(tl.int64) * stride_cs  # hist[j] = row[j], j < N-1
    tok = tl.load(tok_ptr + b).to(tl.int64)  # hist[N-1]
    g = tl.arange(0, BLOCK_H)
    gm = g < HEADS
    order = g // PER_ORDER + 2  # head g hashes c_0 .. c_{order-1}
    # c_0 = the new token; c_s = hist[N-1-s], or eos once an eos lies strictly between (ngram_contexts).
    h = tok * tl.load(mult_ptr)
    hk = tl.zeros((BLOCK_H,), dtype=tl.int64)
    for s in tl.static_range(1, N):
        prev = tl.load(row + (N - 1 - s) * stride_cc)
        if s == 1:
            c = prev
            blocked = prev == eos
        else:
            c = tl.where(blocked, eos, prev).to(tl.int64)
            blocked = blocked | (prev == eos)
        h = h ^ (c * tl.load(mult_ptr + s))  # NOTE: int64 products wrap around, as torch's
        hk = tl.where(order == s + 1, h, hk)
    p = tl.load(sizes_ptr + g, mask=gm, other=1)
    r = hk % p  # C remainder: the sign of hk
    r = tl.where(r < 0, r + p, r)  # torch.remainder: in [0, p) for the positive prime p
    r += tl.load(offs_ptr + g, mask=gm, other=0)
    tl.store(out_ptr + b * HEADS + g, r, mask=gm)
    # The new context is hist[1:]: the old one shifted by one, then the new token.
    j = tl.arange(0, BLOCK_C)
    shifted = tl.load(row + (j + 1) * stride_cc, mask=j + 1 < N - 1, other=0)
    shifted = tl.where(j == N - 2, tok, shifted)
    tl.debug_barrier()  # NOTE: every thread's loads of the slot are done before it is overwritten
    tl.store(row + j * stride_cc, shifted, mask=j < N - 1)


@triton.jit(do_not_specialize=["T"])
def _gate(
    k_ptr, q_ptr, v_ptr, o_ptr, T, H, stride_k, stride_q, stride_v, stride_o, scale,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    ty = o_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    kp = k_ptr + t * stride_k + s * H
    qp = q_ptr + t * stride_q + s * H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, H, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < H
        k = tl.load(kp + c, mask=m, other=0.0).to(tl.float32)
        q = tl.load(qp + c, mask=m, other=0.0).to(tl.float32)
        acc += (k * q).to(ty).to(tl.float32)  # the product is rounded per element, as torch's
    d = tl.sum(acc, axis=0).to(ty).to(tl.float32)  # the sum rounded once
    d = tl.div_rn(d, scale).to(ty).to(tl.float32)  # / sqrt(H), correctly rounded as torch's
    mag = tl.maximum(tl.abs(d), 1e-6).to(ty).to(tl.float32)  # clamp_min(1e-6)
    mag = tl.sqrt_rn(mag).to(ty).to(tl.float32)
    sign = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))  # torch.sign: 0 at 0
    gate = (mag * sign).to(ty).to(tl.float32)
    sig = sigmoid(gate).to(ty).to(tl.float32)
    vp = v_ptr + t * stride_v
    op = o_ptr + t * stride_o + s * H
    for c0 in range(0, H, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < H
        v = tl.load(vp + c, mask=m, other=0.0).to(tl.float32)
        tl.store(op + c, (sig * v).to(ty), mask=m)


def triton_ple_decode_ids(
    ctx_plane: torch.Tensor,
    slots: torch.Tensor,
    input_ids: torch.Tensor,
    mult: torch.Tensor,
    sizes: torch.Tensor,
    offsets: torch.Tensor,
    eos: int,
    per_order: int,
) -> torch.Tensor:
    """ctx_plane [S, N-1] int64 (updated in place at `slots`), slots [B] (distinct), input_ids [B] ->
    table rows [B, n_heads] int64; mult [N], sizes and offsets [n_heads] int64 on the device."""
    N, heads = ctx_plane.shape[1] + 1, sizes.shape[0]
    assert N >= 2 and mult.shape[0] == N and heads == (N - 1) * per_order == offsets.shape[0]
    assert ctx_plane.dtype == mult.dtype == sizes.dtype == offsets.dtype == torch.long
    slots, input_ids = slots.contiguous(), input_ids.contiguous()
    mult, sizes, offsets = mult.contiguous(), sizes.contiguous(), offsets.contiguous()
    B = slots.shape[0]
    out = torch.empty((B, heads), dtype=torch.long, device=ctx_plane.device)
    if B:
        _decode_ids[(B,)](
            ctx_plane, slots, input_ids, mult, sizes, offsets, out, eos,
            ctx_plane.stride(0), ctx_plane.stride(1), N=N, PER_ORDER=per_order, HEADS=heads,
            BLOCK_H=triton.next_power_of_2(heads), BLOCK_C=triton.next_power_of_2(N - 1), num_warps=1,
            **pdl_args(ctx_plane),
        )  # fmt: skip
    return out


def triton_ple_gate(
    key: torch.Tensor, query: torch.Tensor, value: torch.Tensor, n: int, H: int
) -> torch.Tensor:
    """key, query [T, n*H], value [T, H] (one dtype; rows may be strided) -> gated value [T, n*H]."""
    key, query, value = unit_stride(key), unit_stride(query), unit_stride(value)
    T = key.shape[0]
    assert key.shape == query.shape == (T, n * H) and value.shape == (T, H), (key.shape, value.shape)
    out = torch.empty((T, n * H), dtype=key.dtype, device=key.device)
    if T:
        _gate[(T, n)](
            key, query, value, out, T, H, key.stride(0), query.stride(0), value.stride(0), n * H,
            math.sqrt(H), BLOCK=min(BLOCK, triton.next_power_of_2(H)), num_warps=NUM_WARPS, **pdl_args(key),
        )  # fmt: skip
    return out


@triton.jit
def _host_rows(table_ptr, ids_ptr, out_ptr, D, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """out[r] = table[ids[r]] for flat row r; the table may be pinned host memory (read over the bus)."""
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    row = tl.load(ids_ptr + r).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        m = d0 + d < D
        tl.store(out_ptr + r * D + d0 + d, tl.load(table_ptr + row * D + d0 + d, mask=m), mask=m)


def triton_host_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table [R, D] (pinned host memory, or on the device), ids [...] int64 on a CUDA device ->
    [..., D] on that device: one program per row, no host reads (CUDA-graph capturable)."""
    assert table.is_contiguous() and (table.is_cuda or table.is_pinned()), "a pinned host table"
    flat = ids.reshape(-1).contiguous()
    D = table.shape[1]
    out = torch.empty((flat.numel(), D), dtype=table.dtype, device=ids.device)
    if flat.numel():
        _host_rows[(flat.numel(),)](
            table, flat, out, D, BLOCK_D=min(1024, triton.next_power_of_2(D)), **pdl_args(out)
        )  # fmt: skip
    return out.view(*ids.shape, D)
