"""The int4 (W4A16) paths of the Triton kernels (ops/triton/int4_tiles.py: words read in registers, in
either form of int4_dot: eight slab dots a tile, a tile inside one group scaled once per column, or each
tile dequantized in K order into one dot): the GEMV (plain, K-split) and the grouped
experts (decode and prefill, the shared expert too) are close to their 16-bit twins on the dequantized
weights and to float64, and keep rows invariant (torch.equal); the one-pass dequantization of prefill
chunks gives the reference's bits — for groups of 32, 64 and 128, per-channel scales, zero points, and K
that is not a multiple of the tile.

# NOTE: not the twins' bits: the slab form adds a tile's K columns in another order (value i of every
# word, i = 0..7) and, inside one group, scales a sum rather than each weight (int4_tiles.int4_dot); the
# K-order form feeds the twins' values, but from registers (int4_tiles.py's NOTE)."""

from __future__ import annotations

import pytest
import torch
from moe_cases import check_quantized_experts
from triton_interp import DEV, INTERPRET, needs_cuda, small

from nextserve.ops.int4 import Int4Weight, quantize_int4
from nextserve.ops.moe import route

DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
HERE = [pytest.param("here", marks=[] if INTERPRET else [pytest.mark.gpu])]


def _int4(*shape: int, seed: int, group: int, dtype: torch.dtype, zero: bool = False) -> Int4Weight:
    """Random weights [..., N, K] quantized as llm-compressor does (ops/int4.quantize_int4), scales in the
    model dtype (bf16 checkpoints ship bf16 scales); `zero`: with random zero points (asymmetric)."""
    g = torch.Generator().manual_seed(seed)
    w = quantize_int4(torch.randn(*shape, generator=g) / shape[-1] ** 0.5, group, dtype)
    z = torch.randint(-3, 4, w.scale.shape, generator=g, dtype=torch.int8) if zero else None
    return Int4Weight(w.packed.to(DEV), w.scale.to(DEV), None if z is None else z.to(DEV), w.k)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def _close(got: torch.Tensor, twin: torch.Tensor, dtype: torch.dtype) -> None:
    assert _rel(got, twin.double()) < TOL[dtype]


GEMV = [  # (N, K, group, K splits, zero points)
    (40, 256, 128, 1, False),
    (200, 384, 32, 2, False),
    (24, 1024, 128, 3, True),
    (130, 64, 64, None, False),
    (33, 300, 300, None, True),  # per channel, K not a multiple of the tile nor of a word's 8
]
if not INTERPRET:
    GEMV += [(14080, 2560, 128, None, False), (2560, 6144, 128, None, False), (640, 2560, 128, None, True)]


@small
@pytest.mark.parametrize("where", HERE)
@pytest.mark.parametrize("slabs", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,group,splits,zero", GEMV)
def test_int4_gemv_is_the_16_bit_kernel_on_dequantized_weights(
    where, slabs, dtype, N, K, group, splits, zero
):
    from nextserve.ops.triton.gemv import small_m_linear
    from nextserve.ops.triton.gemv_config import gemv_config

    w = _int4(N, K, seed=N + K, group=group, dtype=dtype, zero=zero)
    x = torch.randn(20, K, generator=torch.Generator().manual_seed(1)).to(device=DEV, dtype=dtype)
    got = small_m_linear(x, w, splits=splits, int4_slabs=slabs)
    cfg = gemv_config(N, K, dtype, int4=True)
    twin = small_m_linear(x, w.dequantize(dtype), cfg.block_n, cfg.block_k, splits=splits or cfg.splits)
    _close(got, twin, dtype)
    assert _rel(got, torch.nn.functional.linear(x.double(), w.dequantize(torch.float64))) < TOL[dtype]
    for m in (1, 3, 17):  # row invariance
        assert torch.equal(small_m_linear(x[:m].clone(), w, splits=splits, int4_slabs=slabs), got[:m]), m
    for i in (0, 7, 19) if not INTERPRET else ():  # a row alone (triton_interp.py on the interpreter's dot)
        assert torch.equal(small_m_linear(x[i : i + 1], w, splits=splits, int4_slabs=slabs)[0], got[i])


def test_int4_gemv_configuration():
    """The int4 rule: BLOCK_K one group of 128, BLOCK_N widened while it still launches the target programs
    (up to INT4_TILE_VALUES weights a tile), a function of the shape alone (C1); the measured shapes take
    INT4_TUNED's configuration (the rule's in a 16-bit dtype it was not measured in)."""
    from nextserve.ops.triton.gemv_config import (
        INT4_BLOCK_K,
        INT4_TILE_VALUES,
        INT4_TUNED,
        TARGET_PROGRAMS,
        gemv_config,
        k_splits,
    )  # fmt: skip

    assert INT4_TUNED, "the released projections have measured configurations"
    for (N, K, dtype), (bn, bk, want) in INT4_TUNED.items():
        cfg = gemv_config(N, K, dtype, int4=True)
        assert (cfg.block_n, cfg.block_k) == (bn, bk) == (bn, INT4_BLOCK_K)
        assert (cfg.splits, cfg.split_tiles) == k_splits(N, K, bn, bk, want=want)
        assert bn * bk <= INT4_TILE_VALUES and cfg.preload == 0
        rule = gemv_config(N, K, torch.float16, int4=True)
        assert (rule.block_n, rule.splits) != (bn, cfg.splits)
    for N, K in [(640, 2560), (40, 300), (4, 2048), (16480, 2560)]:
        dtype = torch.float16 if (N, K, torch.bfloat16) in INT4_TUNED else torch.bfloat16
        cfg = gemv_config(N, K, dtype, int4=True)
        assert cfg.block_k == INT4_BLOCK_K and cfg.block_n * cfg.block_k <= INT4_TILE_VALUES
        wider = cfg.block_n * 2
        assert cfg.block_n == 16 or -(-N // cfg.block_n) >= TARGET_PROGRAMS
        assert wider * INT4_BLOCK_K > INT4_TILE_VALUES or -(-N // wider) < TARGET_PROGRAMS
        assert cfg == gemv_config(N, K, dtype, int4=True)


@small
@pytest.mark.parametrize("where", HERE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slabs", [False, True])
@pytest.mark.parametrize("group,zero", [(32, False), (128, True)])
def test_int4_experts_are_the_16_bit_kernels_on_dequantized_weights(where, dtype, slabs, group, zero):
    E, H, I, k = (6, 256, 128, 2) if INTERPRET else (64, 2560, 640, 10)
    q = dict(group=group, dtype=dtype, zero=zero)
    experts = (_int4(E, 2 * I, H, seed=5, **q), _int4(E, H, I, seed=6, **q), _int4(2 * I, H, seed=7, **q),
               _int4(H, I, seed=8, **q))  # fmt: skip
    close = lambda got, twin: _close(got, twin, dtype)  # noqa: E731
    check_quantized_experts(experts, E, k, dtype, close, TOL[dtype], int4_slabs=slabs)


@small
@pytest.mark.parametrize("where", HERE)
def test_int4_experts_refuse_a_shared_expert_of_another_grouping(where):
    from nextserve.ops.triton.moe_grouped import grouped_decode_experts

    E, H, I = 4, 128, 64
    gu, dn = (
        _int4(E, 2 * I, H, seed=1, group=32, dtype=torch.float32),
        _int4(E, H, I, seed=2, group=32, dtype=torch.float32),
    )
    sgu, sdn = (
        _int4(2 * I, H, seed=3, group=64, dtype=torch.float32),
        _int4(H, I, seed=4, group=64, dtype=torch.float32),
    )
    x = torch.randn(2, H).to(DEV)
    w, ids = route(torch.randn(2, E + 1).to(DEV), 2, True, shared=True)
    with pytest.raises(AssertionError, match="grouping"):
        grouped_decode_experts(x, w, ids, gu, dn, shared=(sgu, sdn))


@small
@pytest.mark.parametrize("where", HERE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,group,zero", [((33, 256), 128, False), ((3, 40, 192), 32, True), ((20, 300), 300, False)]
)
def test_one_pass_int4_dequantize_is_the_reference(where, dtype, shape, group, zero):
    from nextserve.ops.triton.int4_dequant import triton_dequantize_int4

    w = _int4(*shape, seed=sum(shape), group=group, dtype=dtype, zero=zero)
    assert torch.equal(triton_dequantize_int4(w, dtype), w.dequantize(dtype))


@small
@pytest.mark.parametrize("where", HERE)
def test_the_reference_ops_dequantize_int4(where):
    from nextserve.ops.linear import linear

    w = _int4(33, 256, seed=10, group=64, dtype=torch.float32, zero=True)
    x = torch.randn(3, 256, dtype=torch.float64, device=DEV)
    want = torch.nn.functional.linear(x, w.dequantize(torch.float64))
    assert torch.equal(linear(x, w, row_invariant=False), want)
    assert torch.allclose(linear(x, w, row_invariant=True), want)


@pytest.mark.gpu
@needs_cuda
def test_linear_dequantizes_int4_prefill_chunks_in_one_pass(monkeypatch):
    from nextserve.ops import int4
    from nextserve.ops.linear import linear
    from nextserve.ops.triton.int4_dequant import triton_dequantize_int4

    w = _int4(640, 2560, seed=11, group=128, dtype=torch.bfloat16)
    x = torch.randn(700, 2560, device="cuda", dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x, triton_dequantize_int4(w, torch.bfloat16))
    monkeypatch.setattr(int4, "dequantize", lambda *a: pytest.fail("the torch dequantize ran"))
    assert torch.equal(linear(x, w, row_invariant=False), want)


@pytest.mark.gpu
@needs_cuda
def test_int4_kernels_replay_in_a_cuda_graph_and_rows_stay_invariant_up_to_40():
    from nextserve.ops.triton.gemv import small_m_linear
    from nextserve.ops.triton.moe_grouped import grouped_decode_experts

    w = _int4(2560, 10240, seed=11, group=128, dtype=torch.bfloat16)
    x = torch.randn(40, 10240, device="cuda", dtype=torch.bfloat16)
    want = small_m_linear(x, w)
    for m in range(1, 41):
        assert torch.equal(small_m_linear(x[:m].clone(), w), want[:m]), m
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = small_m_linear(x[:8], w)
    graph.replay()
    assert torch.equal(out, want[:8])
    E, H, I, k = 512, 2560, 640, 10
    gu, dn = (
        _int4(E, 2 * I, H, seed=5, group=128, dtype=torch.bfloat16),
        _int4(E, H, I, seed=6, group=128, dtype=torch.bfloat16),
    )
    xe = torch.randn(40, H, device="cuda", dtype=torch.bfloat16)
    we, ids = route(torch.randn(40, E, device="cuda", dtype=torch.bfloat16), k, True)
    full = grouped_decode_experts(xe, we, ids, gu, dn)
    for m in (1, 2, 7, 16, 17, 33, 40):
        assert torch.equal(
            grouped_decode_experts(xe[:m].clone(), we[:m].clone(), ids[:m].clone(), gu, dn), full[:m]
        )


def test_float32_rows_in_k_order_fit_shared_memory() -> None:
    """Bug: float32 rows on int4 experts in K order counted half a byte a weight, so the one-row decode
    gate/up ran 8 stages and asked an H100 for 331,776 bytes of shared memory (limit 232,448). Counted as
    the IEEE dot holds it (the dequantized float32 tile), the depth now fits; 16-bit rows keep their count."""
    from nextserve.ops.triton.moe_grouped import FP8_DEEP_STAGES, _fit, _stage_bytes_a_weight

    w = _int4(2, 64, 256, seed=1, group=128, dtype=torch.bfloat16)
    x32, x16 = torch.zeros(1, 256), torch.zeros(1, 256, dtype=torch.bfloat16)
    block_m, block_n, block_k, h100_limit = 16, 32, 128, 232_448
    per_weight = _stage_bytes_a_weight(w, x32, int4_slabs=False)
    stage = int(block_k * (block_m * 4 + 2 * block_n * per_weight))
    depth = _fit(FP8_DEEP_STAGES, stage, k_tiles=20)
    measured = 331_776 / (FP8_DEEP_STAGES - 1)  # a stage's bytes at 8 stages, as the H100 reported them
    assert stage >= measured and (depth - 1) * measured < h100_limit, (stage, depth)
    assert _stage_bytes_a_weight(w, x16, int4_slabs=False) == 0.5
    assert _stage_bytes_a_weight(w, x16, int4_slabs=True) == 1.0


def test_float32_prefill_rows_take_the_k_order_tile(monkeypatch) -> None:
    """Bug: a wide prefill block of float32 rows with int4_slabs asked for the slabs' K tile of 128, though
    float32 rows run the K-order form; at the fewest stages that tile needed 278,528 bytes of shared memory
    (H100 limit 232,448). Its K tile is now the K-order form's 64; 16-bit rows with the slabs keep 128."""
    from nextserve.ops.triton import moe_grouped

    seen = []
    monkeypatch.setattr(moe_grouped, "_grouped", lambda *a, **kw: seen.append((a[7], a[9])))
    w = _int4(2, 64, 256, seed=1, group=128, dtype=torch.bfloat16)
    ids, weights = torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    for dtype, want in ((torch.float32, 64), (torch.bfloat16, 128)):
        moe_grouped.grouped_experts(torch.zeros(3, 256, dtype=dtype), weights, ids, w, w, int4_slabs=True)
        assert seen.pop() == (want, want), dtype
