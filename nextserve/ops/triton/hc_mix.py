"""The hyper-connection mix of decode rows in one launch (CUDA): the per-stream G-norm, the down|inject
GEMV with the low-rank activation, the up GEMV and the sigmoid stream mix.

Reference: `nextserve.ops.hyper.hc_mix`'s torch chain (rms_norm, down_silu, linear, mix_streams).

# NOTE: the plan. x [M, nH] is n streams of H; W_di [R, nH] is the down rows (rank r) then the inject
# rows; W_up [nH, r].
# 1. tiles: W_di is cut into NB blocks of BN rows by NCH chunks of KC columns, none straddling two streams.
#    Tile (b, c) stores the float32 partial of x * (1 + w_norm) (rounded to the dtype) times its weights
#    to ws[c, rows, b's cols], and each row's float32 sum of x^2 over the chunk to sq[b, c, rows];
# 2. reduce: block b's tile that arrives last (a release/acquire counter per block) takes each row's
#    stream scale rstd_s = rsqrt(sum_c sq / H + eps) (chunks in order) and y = sum_s rstd_s * (sum of
#    stream s's partials, in chunk order), then stores silu(y / n) for the down columns (to `a`) and y
#    for the inject columns (to v), rounded where down_silu rounds;
# 3. mix: once every block is reduced (a second counter), each program takes VC of the H columns:
#    logits_s = a @ W_up[s*H + cols]^T and u = mean_s sigmoid(logits_s) * xn_s, xn_s = x_s * rstd_s *
#    (1 + w_norm) rounded where rms_norm and mix_streams round.
# The norm's scale is applied after the down GEMV (rstd_s is one number per row and stream), so the norm
# costs no pass of its own; the results differ from the unfused chain's by roundings only (tests).
# NOTE: C1. Every partition (BN, KC, BM, the r and KC dots) and the order of every sum is a function of
# the shapes and dtype, never of M, of the grid or of which program arrives last; rows go in BM-row blocks
# through tl.dot, whose output element depends only on its own row and column (as in ops/triton/gemv.py).
# So a row's bits do not depend on the rows beside it. The one-launch kernel (MODE 0) and the three-launch
# split (MODE 1, 2, 3: for Triton's interpreter, and while a CUDA graph captures before the counters
# exist) run the same helpers with the same warps: equal bits (tests).
# NOTE: the one-launch kernel waits inside itself (the mix waits for the last reduction), so all its
# programs must be resident at once: its grid is at most one program per SM, and a program calls
# gdc_launch_dependents before anything else, so no kernel launched early behind it (PDL) can take an SM
# before every program of this grid holds one. (An MPS client held to fewer SMs than the device has
# could not hold the grid; nextserve does not run under MPS.)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import launch_pdl, sigmoid

BM = 16  # rows per block
BK = 128  # the phase-1 dot's K step
BKR = 64  # the mix dot's K step
NUM_WARPS = 8
MIX_PROGRAMS = 128  # about this many mix programs (a slice of H columns each)
STAGES = (
    3  # K steps in flight: 41 KB of shared memory and 128 registers at 8 warps, so two programs fit an SM
)
TILE_BYTES = 65536  # weight bytes of a phase-1 tile (BN x KC), fetched into L2 before the PDL wait
N_COUNTERS = 64  # NB block counters, then the role ticket, `reduced` and `exited`
_COUNTERS: dict[torch.device, torch.Tensor] = {}


class Plan(NamedTuple):
    bn: int  # W_di rows per block
    kc: int  # columns per chunk
    cps: int  # chunks per stream
    tiles: int  # NB * NCH
    vc: int  # H columns per mix program
    bc: int  # the mix tile's width (a power of two >= vc)
    units: int  # mix programs: cdiv(H, vc)
    stages: int  # software-pipeline depth of the K loops
    rank_pad: int  # r rounded up to a power of two (the mix dot's K)


@functools.cache
def _plan(n: int, H: int, R: int, rank: int, itemsize: int) -> Plan:
    """A function of the shapes and dtype only: it fixes the numerics."""
    bn = 64 if R >= 64 else max(16, triton.next_power_of_2(R))
    kc = max(16, min(triton.next_power_of_2(H), TILE_BYTES // (bn * itemsize)))
    cps = triton.cdiv(H, kc)
    tiles = triton.cdiv(R, bn) * n * cps
    vc = min(H, max(16, triton.cdiv(H, MIX_PROGRAMS)))
    bc = max(16, triton.next_power_of_2(vc))
    rank_pad = max(16, triton.next_power_of_2(rank))
    return Plan(bn, kc, cps, tiles, vc, bc, triton.cdiv(H, vc), STAGES, rank_pad)


def _counters(device: torch.device) -> torch.Tensor | None:
    """Zeroed int32 counters of `device`, left zero by every call (None while a CUDA graph captures
    before they exist: the split launches run then)."""
    cnt = _COUNTERS.get(device)
    if cnt is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        cnt = _COUNTERS[device] = torch.zeros(N_COUNTERS, dtype=torch.int32, device=device)
    return cnt


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _prefetch_l2(ptrs):
    """Fetch each address's 128-byte line into L2 (nothing waited for)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // $0 unused", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _prefetch_tile(wd_ptr, t, T1, nH, H, R, NCH, CPS: tl.constexpr,
                   BN: tl.constexpr, KC: tl.constexpr, LINE_ELEMS: tl.constexpr):  # fmt: skip
    """Tile t's weights [BN rows, KC columns] into L2 (nothing when t >= T1)."""
    if t < T1:
        b, c = t // NCH, t % NCH
        k_in = tl.minimum((c % CPS) * KC + tl.arange(0, KC // LINE_ELEMS) * LINE_ELEMS, H - 1)
        rows = tl.minimum(b * BN + tl.arange(0, BN), R - 1)
        _prefetch_l2(wd_ptr + rows[:, None].to(tl.int64) * nH + ((c // CPS) * H + k_in)[None, :])


@triton.jit
def _prefetch_unit(wu_ptr, j, H, RANK, VC, NS: tl.constexpr, LINES: tl.constexpr, LINE_ELEMS: tl.constexpr):
    """Mix slice j's W_up rows (VC rows of every stream, contiguous per stream) into L2."""
    last = tl.minimum(VC, H - j * VC) * RANK - 1  # the slice's last element within a stream
    line = tl.minimum(tl.arange(0, LINES) * LINE_ELEMS, last)
    for s in tl.static_range(NS):
        _prefetch_l2(wu_ptr + (s * H + j * VC).to(tl.int64) * RANK + line)


@triton.jit
def _tile(x_ptr, nw_ptr, wd_ptr, ws_ptr, sq_ptr, t, M, stride_x, nH, H, R, NCH, CPS: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, KC: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """Phase 1 for tile t = (b, c): every row's partial over the chunk (BK columns at a time, in order)
    and its sum of squares."""
    ty = wd_ptr.dtype.element_ty
    b, c = t // NCH, t % NCH
    k_lo = (c % CPS) * KC
    col0 = (c // CPS) * H
    rk = tl.arange(0, BK)
    cols = b * BN + tl.arange(0, BN)
    nmask = cols < R
    for m0 in range(0, M, BM):
        rows = m0 + tl.arange(0, BM)
        rmask = rows < M
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        ss = tl.zeros((BM,), dtype=tl.float32)
        for k0 in range(k_lo, k_lo + KC, BK):
            k_in = k0 + rk
            kmask = k_in < H
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + (col0 + k_in)[None, :],
                        mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
            scale = 1.0 + tl.load(nw_ptr + col0 + k_in, mask=kmask, other=0.0).to(tl.float32)
            w = tl.load(wd_ptr + cols[None, :].to(tl.int64) * nH + (col0 + k_in)[:, None],
                        mask=kmask[:, None] & nmask[None, :], other=0.0)  # fmt: skip
            acc += _dot((x * scale[None, :]).to(ty), w, IEEE)  # [BM, BN]
            ss += tl.sum(x * x, axis=1)
        tl.store(ws_ptr + (c * M + rows)[:, None].to(tl.int64) * R + cols[None, :], acc,
                 mask=rmask[:, None] & nmask[None, :])  # fmt: skip
        tl.store(sq_ptr + t * M + rows, ss, mask=rmask)


@triton.jit
def _reduce(ws_ptr, sq_ptr, rstd_ptr, a_ptr, v_ptr, b, M, H, R, RANK, NCH, CPS: tl.constexpr, eps, inv_h, inv_n,
            NS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """Phase 2 for W_di block b, every row: the stream scales, the scaled sum of the partials, the
    activation (down columns) and the inject logits."""
    ty = a_ptr.dtype.element_ty
    cols = b * BN + tl.arange(0, BN)
    nmask = cols < R
    for m0 in range(0, M, BM):
        rows = m0 + tl.arange(0, BM)
        rmask = rows < M
        mask = rmask[:, None] & nmask[None, :]
        y = tl.zeros((BM, BN), dtype=tl.float32)
        for s in tl.static_range(NS):
            ss = tl.zeros((BM,), dtype=tl.float32)
            p = tl.zeros((BM, BN), dtype=tl.float32)
            for j in tl.static_range(CPS):  # unrolled: every partial's load in flight at once
                c = s * CPS + j
                ss += tl.load(sq_ptr + (b * NCH + c) * M + rows, mask=rmask, other=0.0, cache_modifier=".cg")
                p += tl.load(ws_ptr + (c * M + rows)[:, None].to(tl.int64) * R + cols[None, :], mask=mask,
                             other=0.0, cache_modifier=".cg")  # fmt: skip
            r = tl.rsqrt(ss * inv_h + eps)
            y += r[:, None] * p
            if b == 0:
                tl.store(rstd_ptr + rows * NS + s, r, mask=rmask)
        yb = y.to(ty)
        v = (yb.to(tl.float32) * inv_n).to(ty).to(tl.float32)  # silu(y / n), rounded as scaled_silu
        tl.store(a_ptr + rows[:, None] * RANK + cols[None, :], (v / (1.0 + tl.exp(-v))).to(ty),
                 mask=mask & (cols < RANK)[None, :])  # fmt: skip
        tl.store(v_ptr + rows[:, None] * (R - RANK) + (cols - RANK)[None, :], yb,
                 mask=mask & (cols >= RANK)[None, :])  # fmt: skip


@triton.jit
def _mix(x_ptr, nw_ptr, wu_ptr, rstd_ptr, a_ptr, u_ptr, j, M, stride_x, H, RANK, VC, inv_n,
         NS: tl.constexpr, NSP: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr, BKR: tl.constexpr,
         IEEE: tl.constexpr):  # fmt: skip
    """Phase 3 for H columns [j*VC, (j+1)*VC), every row: the n streams' logits in one [BM, NSP*BC]
    product (r in BKR steps, in order), then the stream mix (a fixed-shape sum over the streams)."""
    ty = u_ptr.dtype.element_ty
    idx = tl.arange(0, NSP * BC)  # stream-major: (s, column)
    s_of, cc = idx // BC, idx % BC
    cols = j * VC + cc
    valid = (s_of < NS) & (cc < VC) & (cols < H)
    wrow = (s_of * H + cols).to(tl.int64) * RANK
    rk = tl.arange(0, BKR)
    for m0 in range(0, M, BM):
        rows = m0 + tl.arange(0, BM)
        rmask = rows < M
        lg = tl.zeros((BM, NSP * BC), dtype=tl.float32)
        for k0 in range(0, RANK, BKR):
            kk = k0 + rk
            a = tl.load(a_ptr + rows[:, None] * RANK + kk[None, :], mask=rmask[:, None] & (kk < RANK)[None, :],
                        other=0.0, cache_modifier=".cg")  # fmt: skip
            w = tl.load(
                wu_ptr + wrow[None, :] + kk[:, None], mask=valid[None, :] & (kk < RANK)[:, None], other=0.0
            )
            lg += _dot(a, w, IEEE)
        g = sigmoid(lg.to(ty).to(tl.float32)).to(ty).to(tl.float32)
        mask = rmask[:, None] & valid[None, :]
        r = tl.load(rstd_ptr + rows[:, None] * NS + s_of[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        xs = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + (s_of * H + cols)[None, :], mask=mask,
                     other=0.0).to(tl.float32)  # fmt: skip
        nws = tl.load(nw_ptr + s_of * H + cols, mask=valid, other=0.0).to(tl.float32)
        xn = ((xs * r) * (1.0 + nws)[None, :]).to(ty).to(tl.float32)  # rms_norm's roundings
        p = tl.where(mask, (g * xn).to(ty).to(tl.float32), 0.0)
        u = tl.sum(tl.reshape(p, (BM, NSP, BC)), axis=1)  # [BM, BC]
        out = j * VC + tl.arange(0, BC)
        omask = rmask[:, None] & ((tl.arange(0, BC) < VC) & (out < H))[None, :]
        tl.store(u_ptr + rows[:, None] * H + out[None, :], (u * inv_n).to(ty), mask=omask)


@triton.jit(do_not_specialize=["M"])
def _hc_mix(
    x_ptr, nw_ptr, wd_ptr, wu_ptr, ws_ptr, sq_ptr, rstd_ptr, a_ptr, v_ptr, u_ptr, cnt_ptr,
    M, stride_x, H, R, RANK, VC, UNITS, eps, inv_h, inv_n,
    CPS: tl.constexpr, NS: tl.constexpr, NSP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KC: tl.constexpr,
    BK: tl.constexpr, BC: tl.constexpr, BKR: tl.constexpr, MODE: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr, LINES: tl.constexpr, LINE_ELEMS: tl.constexpr,
):  # fmt: skip
    """MODE 0: the whole mix in one launch, a program per tile and per column slice; 1: the tiles;
    2: the reduction, a program per W_di block; 3: the stream mix, a program per column slice."""
    pid = tl.program_id(0)
    NCH = NS * CPS
    NB = tl.cdiv(R, BN)
    T1 = NB * NCH
    nH = NS * H
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        # no kernel writes weights: fetch them into L2 before the wait (program pid fetches role pid's;
        # whichever program then takes that role reads them from L2)
        if MODE <= 1:
            _prefetch_tile(wd_ptr, pid, T1, nH, H, R, NCH, CPS, BN, KC, LINE_ELEMS)
        if MODE == 0 and pid >= T1:
            _prefetch_unit(wu_ptr, pid - T1, H, RANK, VC, NS, LINES, LINE_ELEMS)
        tl.extra.cuda.gdc_wait()
    if MODE == 1:
        _tile(
            x_ptr, nw_ptr, wd_ptr, ws_ptr, sq_ptr, pid, M, stride_x, nH, H, R, NCH, CPS, BM, BN, KC, BK, IEEE
        )
    elif MODE == 0:
        # Roles go by ticket, in the order programs start: every tile is held by a running program, so the
        # mix programs' wait ends whether or not the whole grid is resident at once.
        role = tl.atomic_add(cnt_ptr + NB, 1, sem="relaxed", scope="gpu")
        if role < T1:
            _tile(x_ptr, nw_ptr, wd_ptr, ws_ptr, sq_ptr, role, M, stride_x, nH, H, R, NCH, CPS, BM, BN, KC, BK,
                  IEEE)  # fmt: skip
            blk = role // NCH
            tl.debug_barrier()  # every thread's partial is stored before the release below
            arrived = tl.atomic_add(cnt_ptr + blk, 1, sem="acq_rel", scope="gpu")
            if arrived == NCH - 1:  # the block's last tile: reduce it
                _reduce(ws_ptr, sq_ptr, rstd_ptr, a_ptr, v_ptr, blk, M, H, R, RANK, NCH, CPS, eps, inv_h, inv_n,
                        NS, BM, BN)  # fmt: skip
                tl.atomic_xchg(cnt_ptr + blk, 0)
                tl.debug_barrier()
                tl.atomic_add(cnt_ptr + NB + 1, 1, sem="release", scope="gpu")
        else:
            j = role - T1
            _prefetch_unit(wu_ptr, j, H, RANK, VC, NS, LINES, LINE_ELEMS)  # in flight during the wait
            done = tl.load(cnt_ptr + NB + 1, volatile=True)  # plain polls: atomics would queue at L2
            while done < NB:
                done = tl.load(cnt_ptr + NB + 1, volatile=True)
            tl.atomic_add(cnt_ptr + NB + 1, 0, sem="acquire", scope="gpu")  # the reductions' stores are seen
            tl.debug_barrier()
            _mix(x_ptr, nw_ptr, wu_ptr, rstd_ptr, a_ptr, u_ptr, j, M, stride_x, H, RANK, VC, inv_n,
                 NS, NSP, BM, BC, BKR, IEEE)  # fmt: skip
        tl.debug_barrier()
        left = tl.atomic_add(cnt_ptr + NB + 2, 1, sem="acq_rel", scope="gpu")
        if left == T1 + UNITS - 1:  # the last program out leaves the counters zero
            tl.atomic_xchg(cnt_ptr + NB, 0)
            tl.atomic_xchg(cnt_ptr + NB + 1, 0)
            tl.atomic_xchg(cnt_ptr + NB + 2, 0)
    elif MODE == 2:
        _reduce(ws_ptr, sq_ptr, rstd_ptr, a_ptr, v_ptr, pid, M, H, R, RANK, NCH, CPS, eps, inv_h, inv_n,
                NS, BM, BN)  # fmt: skip
    else:
        _mix(x_ptr, nw_ptr, wu_ptr, rstd_ptr, a_ptr, u_ptr, pid, M, stride_x, H, RANK, VC, inv_n,
             NS, NSP, BM, BC, BKR, IEEE)  # fmt: skip


def triton_hc_mix(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    w_di: torch.Tensor,
    w_up: torch.Tensor,
    n: int,
    rank: int,
    eps: float,
    one_launch: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [M, n*H] -> (u [M, H], v [M, R - rank] or None when W_di has no inject rows); one dtype. The
    plan is `_plan(shapes, dtype)`; `one_launch=False` runs the three-launch split (the same bits)."""
    M, nH = x.shape
    H = nH // n
    R = w_di.shape[0]
    assert nH == n * H and w_di.shape == (R, nH) and w_up.shape == (nH, rank) and norm_weight.numel() == nH
    assert x.dtype == w_di.dtype == w_up.dtype, (x.dtype, w_di.dtype, w_up.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    nw, w_di, w_up = norm_weight.reshape(nH).contiguous(), w_di.contiguous(), w_up.contiguous()
    p = _plan(n, H, R, rank, x.element_size())
    nb = triton.cdiv(R, p.bn)
    assert nb + 3 <= N_COUNTERS, R
    dev = x.device
    u = torch.empty((M, H), dtype=x.dtype, device=dev)
    v = torch.empty((M, R - rank), dtype=x.dtype, device=dev)
    if M == 0:
        return u, (v if R > rank else None)
    ws = torch.empty((n * p.cps, M, R), dtype=torch.float32, device=dev)
    sq = torch.empty((p.tiles, M), dtype=torch.float32, device=dev)
    rstd = torch.empty((M, n), dtype=torch.float32, device=dev)
    a = torch.empty((M, rank), dtype=x.dtype, device=dev)
    pdl = launch_pdl(x)
    cnt = _counters(dev) if one_launch and dev.type == "cuda" else None
    lines = triton.next_power_of_2(triton.cdiv(p.vc * rank * x.element_size(), 128))
    args = (x, nw, w_di, w_up, ws, sq, rstd, a, v if R > rank else a, u)
    scalars = (M, x.stride(0), H, R, rank, p.vc, p.units, eps, 1.0 / H, 1.0 / n)
    consts = dict(CPS=p.cps, NS=n, NSP=triton.next_power_of_2(n), BM=BM, BN=p.bn, KC=p.kc, BK=min(BK, p.kc), BC=p.bc,
                  BKR=min(BKR, p.rank_pad), IEEE=x.dtype == torch.float32,
                  PDL=pdl, LINES=lines, LINE_ELEMS=128 // x.element_size(), num_warps=NUM_WARPS, num_stages=p.stages, launch_pdl=pdl)  # fmt: skip
    if cnt is not None:
        _hc_mix[(p.tiles + p.units,)](*args, cnt, *scalars, MODE=0, **consts)
    else:
        for mode, grid in ((1, p.tiles), (2, nb), (3, p.units)):
            _hc_mix[(grid,)](*args, ws, *scalars, MODE=mode, **consts)
    return u, (v if R > rank else None)
