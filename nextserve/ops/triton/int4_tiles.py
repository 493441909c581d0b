"""Pieces the int4 (W4A16) kernels share: packed words to a weight tile in registers, and what a launch
passes for an Int4Weight (ops/int4.py's layout: eight 4-bit values along K to an int32 word, lowest bits
first, stored plus 8; scales [.., N, K / G] in a 16-bit dtype; optional int8 zero points of that shape).

# NOTE: a tile's weights get ops/int4.py `dequantize`'s bits: (stored - 8 - zero) is an integer of at most
# 5 bits and the scale a 16-bit float, so their product is exact in float32, and it is rounded once to the
# scale's dtype (the weight's value as the format library computes it), then given the activations' dtype.
# The kernels then compute as their 16-bit twins do on those values (float32 accumulation, the same
# tiling): in the interpreter and in float32 the twins' bits; in 16-bit dtypes on a GPU a dot fed from
# registers may be lowered differently from one fed from memory (ops/fp8.py's NOTE), so there: close.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..int4 import Int4Weight


@triton.jit
def unpack_words(words, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_K // 8, BLOCK_N] int32 words -> their [BLOCK_K, BLOCK_N] signed values (stored - 8, int32):
    row 8 * j + i is value i of word row j (bits 4i..4i+3)."""
    shifts = tl.arange(0, 8) * 4
    v = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BK // 8, 8, BN]
    return tl.reshape(v, (BLOCK_K, BLOCK_N)) - 8


@triton.jit
def int4_tile(
    w_ptrs, w_mask, s_rows, z_rows, k0, rk, k_hi, col_ok, ty: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ZERO: tl.constexpr,
):  # fmt: skip
    """The [BLOCK_K, BLOCK_N] weight tile of K columns k0 + rk (k0 a multiple of BLOCK_K), in ty, from the
    words at w_ptrs [BLOCK_K // 8, BLOCK_N] (w_mask: which to load, None for all): `dequantize_words`."""
    if w_mask is None:
        words = tl.load(w_ptrs)
    else:
        words = tl.load(w_ptrs, mask=w_mask, other=0)
    return dequantize_words(
        words, s_rows, z_rows, k0, rk, k_hi, col_ok, ty, GROUP, BLOCK_K, BLOCK_N, HAS_ZERO
    )


@triton.jit
def dequantize_words(
    words, s_rows, z_rows, k0, rk, k_hi, col_ok, ty: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ZERO: tl.constexpr,
):  # fmt: skip
    """The [BLOCK_K, BLOCK_N] weight tile, in K order and ty, of words [BLOCK_K // 8, BLOCK_N] (K columns
    k0 + rk) and each column's row of group scales s_rows [BLOCK_N] (zero points z_rows with HAS_ZERO). A
    tile inside one group (GROUP a multiple of BLOCK_K) loads one scale a column; otherwise each value's
    group scale is gathered (columns past k_hi and masked-off columns get scale 0). The module NOTE gives
    the roundings.

    # NOTE: speed. With 16-bit scales (every checkpoint's) the values are made in the scales' dtype, each
    # word's eight in one thread (`_words_in_k_order`), and (q - zero) * scale is one 16-bit multiply: the
    # exact product rounded once, the module NOTE's bits. Unpacking by a broadcast over eight shifts and a
    # reshape instead converted every value from an integer (a quarter-rate instruction) and gave a thread
    # values four K columns apart (16-bit stores into the dot's shared tile): 335 instructions a tile of
    # the GEMV's loop against 227 (sm_90 SASS of the in_proj configuration; BENCHMARKS.md, W4A16)."""
    sty: tl.constexpr = s_rows.dtype.element_ty
    HALF: tl.constexpr = sty == tl.bfloat16 or sty == tl.float16
    if HALF:
        q = tl.trans(_words_in_k_order(tl.trans(words), sty))  # [BLOCK_K, BLOCK_N], sty, exact
    else:
        q = unpack_words(words, BLOCK_K, BLOCK_N).to(tl.float32)
    if GROUP % BLOCK_K == 0:
        g = k0 // GROUP
        s = tl.load(s_rows + g, mask=col_ok, other=0.0)[None, :]
        if HAS_ZERO:
            q -= tl.load(z_rows + g, mask=col_ok, other=0)[None, :].to(q.dtype)
    else:
        kk = k0 + rk
        m = (kk < k_hi)[:, None] & col_ok[None, :]
        g = (kk // GROUP)[:, None]
        s = tl.load(s_rows[None, :] + g, mask=m, other=0.0)
        if HAS_ZERO:
            q -= tl.load(z_rows[None, :] + g, mask=m, other=0).to(q.dtype)
    if HALF:
        w = q * s
    else:
        w = (q * s.to(tl.float32)).to(sty)
    return w.to(ty)


@triton.jit
def _stored_in_mantissa(words, i: tl.constexpr, sty: tl.constexpr):
    """Value i of each int32 word (bits 4i..4i+3, stored plus 8) as sty, exactly: the stored bits put in the
    mantissa of a float of unit step (2^7 + stored in bf16, 2^10 + stored in fp16) and 2^7 + 8 (2^10 + 8)
    taken away, an integer-to-float conversion saved (a quarter-rate instruction)."""
    BASE: tl.constexpr = 0x4300 if sty == tl.bfloat16 else 0x6400
    OFF: tl.constexpr = 136.0 if sty == tl.bfloat16 else 1032.0
    v = (((words >> (4 * i)) & 0xF) | BASE).to(tl.int16).to(sty, bitcast=True)
    return v - OFF


@triton.jit
def _words_in_k_order(words, sty: tl.constexpr):
    """words [BLOCK_N, W] (K last) -> their values [BLOCK_N, 8 * W] in K order, in sty (16-bit): value i of
    word j at column 8j + i. Three levels of interleaves keep a word's eight values in one thread (a join's
    new dimension is a thread's own registers), where a reshape of a broadcast over the eight shifts may
    spread them over the warps."""
    # columns 4j + 0..3 of c0 hold values 0, 2, 4, 6 of word j; of c1 values 1, 3, 5, 7
    c0 = tl.interleave(
        tl.interleave(_stored_in_mantissa(words, 0, sty), _stored_in_mantissa(words, 4, sty)),
        tl.interleave(_stored_in_mantissa(words, 2, sty), _stored_in_mantissa(words, 6, sty)),
    )
    c1 = tl.interleave(
        tl.interleave(_stored_in_mantissa(words, 1, sty), _stored_in_mantissa(words, 5, sty)),
        tl.interleave(_stored_in_mantissa(words, 3, sty), _stored_in_mantissa(words, 7, sty)),
    )
    return tl.interleave(c0, c1)


@triton.jit
def _values(words, i: tl.constexpr):
    """Value i of each int32 word (bits 4i..4i+3, stored plus 8) as float32, exactly: the 4 bits put in the
    mantissa of 2^23 (the float 2^23 + stored) and 2^23 + 8 taken away, an add where an int-to-float
    conversion would run at a quarter of its rate."""
    magic = ((words >> (4 * i)) & 0xF) | 0x4B000000
    return magic.to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def int4_dot(
    acc, x_rows, mask_m, words, s_rows, z_rows, col_ok, k0, k_hi, ty: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZERO: tl.constexpr, PRECISION: tl.constexpr,
    SLABS: tl.constexpr = True,
):  # fmt: skip
    """acc + x[rows, k0 : k0 + BLOCK_K] @ W[k0 : k0 + BLOCK_K, cols] from the tile's words [BLOCK_K // 8,
    BLOCK_N] (k0 a multiple of BLOCK_K), x's rows at x_rows [BLOCK_M, 1] (mask_m [BLOCK_M, 1]), K columns
    past k_hi zeros. SLABS: eight dots over the words' value slabs (BLOCK_K a multiple of 128: a dot's K
    is at least 16); else the tile dequantized in K order (`dequantize_words`) and one dot.

    # NOTE: SLABS: eight dots of BLOCK_K // 8 columns each, in the fixed order i = 0..7: value i of every
    # word (K columns k0 + 8j + i) against x's matching columns, so the words are never reshuffled into K
    # order in registers (a reshape of [BLOCK_K // 8, 8, BLOCK_N] is a layout conversion through shared
    # memory). A tile inside one group (GROUP a multiple of BLOCK_K) feeds the codes themselves (q - zero,
    # integers of at most 5 bits: exact in any 16-bit float) and scales the tile's float32 sum once per
    # column, as block-FP8 GEMMs do; otherwise each value is dequantized first (ops/int4.py's roundings).
    # Which form a kernel runs is a launch constant, never a function of M: rows stay invariant either way.
    # Speed differs by kernel (gemv_config.INT4_SLABS, moe_grouped's NOTE; BENCHMARKS.md, W4A16)."""
    # (one return at the end: code after a return in a constexpr branch is still compiled)
    BLOCK_N: tl.constexpr = acc.shape[1]
    if not SLABS:
        rk = tl.arange(0, BLOCK_K)
        kk = k0 + rk
        w = dequantize_words(
            words, s_rows, z_rows, k0, rk, k_hi, col_ok, ty, GROUP, BLOCK_K, BLOCK_N, HAS_ZERO
        )
        x = tl.load(x_rows + kk[None, :], mask=mask_m & (kk[None, :] < k_hi), other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    else:
        acc = _slab_dots(
            acc, x_rows, mask_m, words, s_rows, z_rows, col_ok, k0, k_hi, ty, GROUP, BLOCK_K, HAS_ZERO,
            PRECISION,
        )  # fmt: skip
    return acc


@triton.jit
def _slab_dots(
    acc, x_rows, mask_m, words, s_rows, z_rows, col_ok, k0, k_hi, ty: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZERO: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """`int4_dot`'s slab form: the eight dots of its NOTE."""
    rkw = tl.arange(0, BLOCK_K // 8) * 8
    ONE: tl.constexpr = GROUP % BLOCK_K == 0
    part = tl.zeros(acc.shape, dtype=tl.float32)
    if ONE:
        g = k0 // GROUP
        s = tl.load(s_rows + g, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_rows + g, mask=col_ok, other=0).to(tl.float32)[None, :]
    for i in tl.static_range(8):
        kk = k0 + rkw + i  # [BLOCK_K // 8] this slab's K columns
        x = tl.load(x_rows + kk[None, :], mask=mask_m & (kk[None, :] < k_hi), other=0.0)
        q = _values(words, i)  # [BLOCK_K // 8, BLOCK_N] float32, exact
        if ONE:
            if HAS_ZERO:
                q -= z
            part = tl.dot(x, q.to(ty), part, input_precision=PRECISION)
        else:
            m = (kk < k_hi)[:, None] & col_ok[None, :]
            gi = (kk // GROUP)[:, None]
            sg = tl.load(s_rows[None, :] + gi, mask=m, other=0.0)
            if HAS_ZERO:
                q -= tl.load(z_rows[None, :] + gi, mask=m, other=0).to(tl.float32)
            w = (q * sg.to(tl.float32)).to(s_rows.dtype.element_ty).to(ty)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if ONE:
        acc += part * s[None, :]
    return acc


def int4_launch_args(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """(words, scales, zero points or the scales as a placeholder, constexpr keywords) of an int4 weight
    for a kernel: unit-stride words and scales, GROUP, HAS_ZERO."""
    packed = w.packed if w.packed.stride(-1) == 1 else w.packed.contiguous()
    scale = w.scale.contiguous()
    zero = scale if w.zero is None else w.zero.contiguous()
    return packed, scale, zero, {"GROUP": w.group, "HAS_ZERO": w.zero is not None}


def check_block_k(block_k: int, slabs: bool) -> None:
    """A K tile of int4 weights (`int4_dot`) is whole words and a dot's K is at least 16: with `slabs` a
    multiple of 128 columns (each of its eight dots 16 or more), else 16 or more."""
    assert block_k % (128 if slabs else 16) == 0, (block_k, slabs)
