"""Batched QSA decode over the paged KV cache for CUDA: indexer block scores and sparse attention.
References: `index_scores` / `paged_sparse_attention` in nextserve/ops/attention.py (CPU paths).

# NOTE: row invariance (C1) and CUDA graphs. Every program reads one row's inputs only, and the tile
# sizes, the split of a row's token list and the combine order are fixed by constexprs and by the
# token list's length L (the same for every row of a call, and independent of B): a row's bits are the
# same alone or in any batch. No host reads, shapes fixed by the inputs' shapes: graph-capturable.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start
from .kv8 import dequantize_rows, kv8_args

LOG2E = 1.4426950408889634


# NOTE: the integers that vary with a request's length (block counts, block-table and token-list widths,
# split counts) are not specialised on (== 1, multiple of 16): each value class compiled a binary of its
# own, at a request's first chunk after the warm-up (tests/gpu/test_warm_up.py).
@triton.jit(do_not_specialize=["max_blocks", "stride_btb", "stride_ob"])
def _index_scores_kernel(
    q_ptr, key_ptr, ks_ptr, bt_ptr, nb_ptr, out_ptr, max_blocks, bpp, inv_scale,
    stride_qb, stride_qh, stride_kp, stride_ki, stride_ksp, stride_btb, stride_ob,
    NI: tl.constexpr, DI: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_J: tl.constexpr,
    KV8: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    b = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    nb = tl.load(nb_ptr + b)
    valid = j < nb
    page = tl.load(bt_ptr + b * stride_btb + j // bpp, mask=valid, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_DI)
    dm = d < DI
    keys = tl.load(
        key_ptr + page[:, None] * stride_kp + (j % bpp)[:, None] * stride_ki + d[None, :],
        mask=valid[:, None] & dm[None, :],
        other=0.0,
    )
    if KV8:
        ks = tl.load(ks_ptr + page * stride_ksp + j % bpp, mask=valid, other=0.0)
        keys = dequantize_rows(keys, ks, q_ptr.dtype.element_ty)
    keys = keys.to(tl.float32)
    acc = tl.zeros((BLOCK_J,), dtype=tl.float32)
    for h in tl.static_range(NI):
        qh = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=dm, other=0.0).to(tl.float32)
        acc += tl.maximum(tl.sum(keys * qh[None, :], axis=1), 0.0)
    score = tl.where(valid, acc * inv_scale, float("-inf"))
    tl.store(out_ptr + b * stride_ob + j, score, mask=j < max_blocks)


def triton_index_scores(
    q_idx: torch.Tensor,
    key_plane: torch.Tensor,
    block_table: torch.Tensor,
    n_blocks: torch.Tensor,
    max_blocks: int,
    block_j: int = 64,
) -> torch.Tensor:
    """q_idx [B, Ni, di], key_plane [pages, bpp, di] (or an Kv8Plane of it), block_table [B, maxP],
    n_blocks [B] -> [B, max_blocks] float32: sum_h relu(q_h . k_j) / sqrt(di) for j < n_blocks[b], -inf
    after. Grid (B, max_blocks / block_j); each program scores block_j blocks of one row in float32."""
    B, NI, DI = q_idx.shape
    q_idx = q_idx if q_idx.stride(-1) == 1 else q_idx.contiguous()
    key_plane, key_scale, kv8 = kv8_args(key_plane)
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    n_blocks = n_blocks.contiguous()
    out = torch.empty((B, max_blocks), dtype=torch.float32, device=q_idx.device)
    if B == 0 or max_blocks == 0:
        return out
    grid = (B, triton.cdiv(max_blocks, block_j))
    _index_scores_kernel[grid](
        q_idx, key_plane, key_scale, block_table, n_blocks, out, max_blocks, key_plane.shape[1],
        1.0 / math.sqrt(DI), q_idx.stride(0), q_idx.stride(1), key_plane.stride(0), key_plane.stride(1),
        key_scale.stride(0), block_table.stride(0), out.stride(0),
        NI=NI, DI=DI, BLOCK_DI=triton.next_power_of_2(DI), BLOCK_J=block_j, KV8=kv8, **pdl_args(q_idx),
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["L", "tiles_per_split", "stride_btb", "stride_tb", "stride_mb", "stride_mh"])
def _paged_attn_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, tok_ptr, mo_ptr, mm_ptr, ml_ptr, o_ptr,
    L, tiles_per_split, page_size, qk_scale,
    stride_qb, stride_qh, stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh,
    stride_sp, stride_so,
    stride_btb, stride_tb, stride_mob, stride_moh, stride_mos, stride_mb, stride_mh, stride_ob, stride_oh,
    REP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    TILE: tl.constexpr, IEEE: tl.constexpr, DIRECT: tl.constexpr = False,
    KV8: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """One (row, kv head, split): online softmax over the split's tiles of the row's token list,
    for the kv head's REP query heads at once. Writes the unnormalised output, max and sum (log2);
    DIRECT (one split) the normalised output itself, the bits the combine gives one split."""
    pdl_start(PDL)
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    hs = tl.arange(0, BLOCK_H)
    hm = hs < REP
    heads = g * REP + hs
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=hm[:, None] & dm[None, :],
        other=0.0,
    )
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    start = s * tiles_per_split * TILE
    for t in range(0, tiles_per_split):
        idx = start + t * TILE + tl.arange(0, TILE)
        tok = tl.load(tok_ptr + b * stride_tb + idx, mask=idx < L, other=-1)
        valid = tok >= 0
        if tl.max(tok, axis=0) >= 0:  # a tile of padding only costs nothing
            page = tl.load(bt_ptr + b * stride_btb + tok // page_size, mask=valid, other=0).to(tl.int64)
            off = (tok % page_size).to(tl.int64)
            kv_m = valid[:, None] & dm[None, :]
            k = tl.load(
                k_ptr + page[:, None] * stride_kp + off[:, None] * stride_ko + g * stride_kh + d[None, :],
                mask=kv_m,
                other=0.0,
            )
            if KV8:  # (the scale planes [pages, P, Nkv] share their strides)
                scale_at = page * stride_sp + off * stride_so + g
                k = dequantize_rows(k, tl.load(ks_ptr + scale_at, mask=valid, other=0.0), q.dtype)
            if IEEE:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))  # [BLOCK_H, TILE], log2 units
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_ptr + page[:, None] * stride_vp + off[:, None] * stride_vo + g * stride_vh + d[None, :],
                mask=kv_m,
                other=0.0,
            )
            if KV8:
                v = dequantize_rows(v, tl.load(vs_ptr + scale_at, mask=valid, other=0.0), q.dtype)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
    if DIRECT:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # one split: w = 1, den = l (combine's rule)
        o_off = b * stride_ob + heads * stride_oh
        o_m = hm[:, None] & dm[None, :]
        tl.store(o_ptr + o_off[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=o_m)
    else:
        base = b * stride_mob + heads * stride_moh + s * stride_mos
        tl.store(mo_ptr + base[:, None] + d[None, :], acc, mask=hm[:, None] & dm[None, :])
        tl.store(mm_ptr + b * stride_mb + heads * stride_mh + s, m_i, mask=hm)
        tl.store(ml_ptr + b * stride_mb + heads * stride_mh + s, l_i, mask=hm)


@triton.jit(do_not_specialize=["S", "stride_mb", "stride_mh"])
def _paged_attn_combine_kernel(
    mo_ptr, mm_ptr, ml_ptr, o_ptr, S,
    stride_mob, stride_moh, stride_mos, stride_mb, stride_mh, stride_ob, stride_oh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """One (row, q head): merge the splits in one fixed reduction; no valid token gives zeros."""
    pdl_start(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    ss = tl.arange(0, BLOCK_S)
    sm = ss < S
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    m = tl.load(mm_ptr + b * stride_mb + h * stride_mh + ss, mask=sm, other=float("-inf"))
    l_s = tl.load(ml_ptr + b * stride_mb + h * stride_mh + ss, mask=sm, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # no valid token at all: no inf - inf
    w = tl.exp2(m - m_max)  # 0 for splits without a valid token
    den = tl.sum(w * l_s, axis=0)
    o_s = tl.load(
        mo_ptr + b * stride_mob + h * stride_moh + ss[:, None] * stride_mos + d[None, :],
        mask=sm[:, None] & dm[None, :],
        other=0.0,
    )
    num = tl.sum(w[:, None] * o_s, axis=0)
    out = num / tl.where(den > 0.0, den, 1.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=dm)


def triton_paged_sparse_attention(
    q: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    block_table: torch.Tensor,
    tokens: torch.Tensor,
    scaling: float,
    tile: int = 32,
    num_splits: int = 32,
    num_warps: int = 4,
) -> torch.Tensor:
    """q [B, Nq, D]; k_plane, v_plane [pages, P, Nkv, D] (or Kv8Planes of them: each tile dequantized to
    q's dtype as it is loaded); block_table [B, maxP]; tokens [B, L] (-1 = none) -> [B, Nq, D] in
    q.dtype: each row's attention over its valid tokens (GQA).

    Grid (B, Nkv, S) then (B, Nq): the token list is cut into `tile`-token tiles, the tiles into
    S = ceil(tiles / ceil(tiles / num_splits)) consecutive splits (S depends on L only, never on B).
    A split's program runs the online softmax (float32, log2 domain) over its tiles in order for the
    kv head's Nq/Nkv query heads together (padded to 16 rows for the MMA); the combine kernel merges
    a row's S partial results in one fixed reduction. `tile` and `num_splits` are part of the numerics.
    """
    B, Nq, D = q.shape
    P, Nkv = k_plane.shape[1], k_plane.shape[2]
    L = tokens.shape[1]
    rep = Nq // Nkv
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_plane, k_scale, kv8 = kv8_args(k_plane)
    v_plane, v_scale, _ = kv8_args(v_plane)
    assert k_scale.stride() == v_scale.stride(), "the K and V scale planes share their strides"
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    tokens = tokens if tokens.stride(-1) == 1 else tokens.contiguous()
    out = torch.empty((B, Nq, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    n_tiles = max(1, triton.cdiv(L, tile))
    tiles_per_split = triton.cdiv(n_tiles, num_splits)
    S = triton.cdiv(n_tiles, tiles_per_split)
    direct = S == 1
    # NOTE: one split writes the output itself (the combine's bits for one split): no partials
    mo = torch.empty((B, Nq, 1 if direct else S, D), dtype=torch.float32, device=q.device)
    mm = torch.empty((B, Nq, 1 if direct else S), dtype=torch.float32, device=q.device)
    ml = torch.empty_like(mm)
    BLOCK_D = triton.next_power_of_2(D)
    _paged_attn_split_kernel[(B, Nkv, S)](
        q, k_plane, v_plane, k_scale, v_scale, block_table, tokens, mo, mm, ml, out,
        L, tiles_per_split, P, scaling * LOG2E,
        q.stride(0), q.stride(1), k_plane.stride(0), k_plane.stride(1), k_plane.stride(2),
        v_plane.stride(0), v_plane.stride(1), v_plane.stride(2), k_scale.stride(0), k_scale.stride(1),
        block_table.stride(0), tokens.stride(0), mo.stride(0), mo.stride(1), mo.stride(2),
        mm.stride(0), mm.stride(1), out.stride(0), out.stride(1),
        REP=rep, BLOCK_H=max(16, triton.next_power_of_2(rep)), D=D, BLOCK_D=BLOCK_D, TILE=tile,
        IEEE=q.dtype == torch.float32, DIRECT=direct, KV8=kv8, num_warps=num_warps, **pdl_args(q),
    )  # fmt: skip
    if not direct:
        _paged_attn_combine_kernel[(B, Nq)](
            mo, mm, ml, out, S,
            mo.stride(0), mo.stride(1), mo.stride(2), mm.stride(0), mm.stride(1),
            out.stride(0), out.stride(1),
            D=D, BLOCK_D=BLOCK_D, BLOCK_S=triton.next_power_of_2(S), **pdl_args(mo),
        )  # fmt: skip
    return out
