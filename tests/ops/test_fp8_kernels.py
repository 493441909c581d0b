"""The FP8 paths of the Triton kernels (ops/fp8.py: weights read as FP8): the GEMV (plain, K-split, with
the SiLU and stream-mix epilogues; each tile's partial scaled per column, gemv._weight_args) and the
grouped experts (decode and prefill, the shared expert too; each tile dequantized in registers) are close
to float64 on the dequantized weights, rows stay invariant (torch.equal), and where the dot has no
tensor-core path to choose (float32, and every dtype in Triton's interpreter) the dequantizing kernels give
their 16-bit twins' bits on the dequantized weights (the GEMV's earlier form, post_scale=False, too).

# NOTE: on a GPU the 16-bit FP8 tiles reach tl.dot from registers, the 16-bit twin's from memory: the
# compiler may lower the two dots differently (seen on the H200: not the same bits in bf16 and fp16, in
# fp32 the same), so there the twin is a closeness oracle, not a bit-for-bit one."""

from __future__ import annotations

import pytest
import torch
from moe_cases import check_quantized_experts
from triton_interp import DEV, INTERPRET, needs_cuda, row_independent_dot, small  # noqa: F401

from nextserve.ops.fp8 import Fp8Weight, quantize

DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# NOTE: each test runs where the kernels can (tests/triton_interp.py): in the interpreter on the CPU, and
# under `-m gpu` on a GPU, where these same cases (and the real widths below) run as GPU tests
HERE = [pytest.param("here", marks=[] if INTERPRET else [pytest.mark.gpu])]


def _fp8(*shape: int, seed: int) -> Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) / shape[-1] ** 0.5
    q, s = quantize(w)
    return Fp8Weight(q.to(DEV), s.to(DEV))


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def _same_or_close(got: torch.Tensor, twin: torch.Tensor, dtype: torch.dtype, bits: bool = True) -> None:
    """Bit for bit where the dot cannot differ (the NOTE above) and the kernel dequantizes each weight
    (`bits`), else within the dtype's rounding."""
    if bits and (INTERPRET or dtype == torch.float32):
        assert torch.equal(got, twin)
    else:
        assert _rel(got, twin.double()) < TOL[dtype]


GEMV = [(40, 300, 1), (200, 300, 2), (24, 1100, 3), (130, 64, None), (4, 2048, None)]
if not INTERPRET:
    GEMV += [
        (2560, 10240, None),
        (14080, 2560, None),
        (2560, 6144, None),
        (48, 2560, None),
        (640, 2560, None),
    ]


@small
@pytest.mark.parametrize("where", HERE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("post", [True, False])
@pytest.mark.parametrize("N,K,splits", GEMV)
def test_fp8_gemv_follows_the_16_bit_kernel_on_dequantized_weights(where, dtype, post, N, K, splits):
    from nextserve.ops.triton.gemv import small_m_linear
    from nextserve.ops.triton.gemv_config import gemv_config

    w = _fp8(N, K, seed=N + K)
    x = torch.randn(20, K, generator=torch.Generator().manual_seed(1)).to(device=DEV, dtype=dtype)
    run = dict(splits=splits, post_scale=post)
    got = small_m_linear(x, w, **run)
    plain = w.dequantize(dtype)
    if post:  # the twin in the FP8 configuration (tiles of one scale block): close, not the same bits
        cfg = gemv_config(N, K, dtype, fp8=True)
        twin = small_m_linear(x, plain, cfg.block_n, cfg.block_k, splits=splits or cfg.splits)
    else:
        twin = small_m_linear(x, plain, splits=splits)
    _same_or_close(got, twin, dtype, bits=not post)
    assert _rel(got, torch.nn.functional.linear(x.double(), w.dequantize(torch.float64))) < TOL[dtype]
    for m in (1, 3, 17):  # row invariance
        assert torch.equal(small_m_linear(x[:m].clone(), w, **run), got[:m]), m
    for i in (0, 7, 19) if not INTERPRET else ():  # a row alone (the interpreter's dot is the CPU BLAS'
        assert torch.equal(small_m_linear(x[i : i + 1], w, **run)[0], got[i])  # : triton_interp.py)


def test_fp8_gemv_configuration_tiles_one_scale_block():
    """The FP8 rule: BLOCK_K one scale block, BLOCK_N widened while it still launches the target programs
    (up to 8 KB FP8 tiles), a function of the shape alone (C1)."""
    from nextserve.ops.triton.gemv_config import FP8_BLOCK_K, FP8_TUNED, TARGET_PROGRAMS, gemv_config

    for N, K in [(16480, 2560), (13952, 2560), (2560, 6144), (12800, 2560), (40, 300), (4, 2048)]:
        cfg = gemv_config(N, K, torch.bfloat16, fp8=True)
        assert cfg.block_k == FP8_BLOCK_K and cfg.block_n * cfg.block_k <= 8192
        if (N, K, torch.bfloat16) in FP8_TUNED:  # a measured configuration instead of the rule
            assert (cfg.block_n, cfg.block_k) == FP8_TUNED[N, K, torch.bfloat16][:2]
            continue
        wider = cfg.block_n * 2
        assert cfg.block_n == 16 or -(-N // cfg.block_n) >= TARGET_PROGRAMS
        assert wider * FP8_BLOCK_K > 8192 or -(-N // wider) < TARGET_PROGRAMS
        assert cfg == gemv_config(N, K, torch.bfloat16, fp8=True)


@small
@pytest.mark.parametrize("where", HERE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_gemv_epilogues(where, dtype):
    from nextserve.ops.triton.gemv import small_m_linear, small_m_linear_mix

    n, hidden, r = 4, 64, 48
    down = _fp8(r + n, n * hidden, seed=3)
    xn = torch.randn(5, n * hidden).to(device=DEV, dtype=dtype)
    plain = down.dequantize(dtype)
    a = small_m_linear(xn, down, silu_cols=r, silu_scale=1 / n)
    _same_or_close(a, small_m_linear(xn, plain, 16, 128, silu_cols=r, silu_scale=1 / n), dtype, bits=False)
    up = _fp8(n * hidden, r, seed=4)
    act = a[:, :r].contiguous()
    u = small_m_linear_mix(act, up, xn, n, hidden)
    assert u is not None
    _same_or_close(u, small_m_linear_mix(act, up.dequantize(dtype), xn, n, hidden), dtype, bits=False)


@small
@pytest.mark.parametrize("where", HERE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_experts_are_the_16_bit_kernels_on_dequantized_weights(where, dtype, monkeypatch):
    """The weights-only form (decode rows always; prefill with PREFILL_EXPERTS_W8A8 off, the default:
    tests/ops/test_fp8_w8a8.py has the W8A8 prefill experts)."""
    from nextserve.ops.triton import moe_grouped

    monkeypatch.setattr(moe_grouped, "PREFILL_EXPERTS_W8A8", False)
    E, H, I, k = (6, 256, 128, 2) if INTERPRET else (64, 2560, 640, 10)
    experts = (_fp8(E, 2 * I, H, seed=5), _fp8(E, H, I, seed=6), _fp8(2 * I, H, seed=7), _fp8(H, I, seed=8))
    check_quantized_experts(
        experts, E, k, dtype, lambda got, twin: _same_or_close(got, twin, dtype), TOL[dtype]
    )


@pytest.mark.gpu
@needs_cuda
def test_linear_dequantizes_fp8_prefill_chunks_in_one_pass(monkeypatch):
    """Without W8A8 (ops/triton/fp8_gemm.py PREFILL_W8A8 off, or a card without FP8 MMAs) a prefill chunk's
    FP8 projection is F.linear on the weight dequantized by the one-pass kernel (the torch dequantize,
    several passes over float32 copies, is not called)."""
    from nextserve.ops import fp8
    from nextserve.ops.linear import linear
    from nextserve.ops.triton import fp8_gemm
    from nextserve.ops.triton.fp8_dequant import triton_dequantize

    monkeypatch.setattr(fp8_gemm, "PREFILL_W8A8", False)
    w = _fp8(640, 2560, seed=11)
    x = torch.randn(700, 2560, device="cuda", dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x, triton_dequantize(w, torch.bfloat16))
    monkeypatch.setattr(fp8, "dequantize", lambda *a: pytest.fail("the torch dequantize ran"))
    assert torch.equal(linear(x, w, row_invariant=False), want)


@small
@pytest.mark.parametrize("where", HERE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", [(33, 200), (300, 384), (256, 128)])
def test_one_pass_dequantize_is_the_reference(where, dtype, N, K):
    from nextserve.ops.triton.fp8_dequant import triton_dequantize

    w = _fp8(N, K, seed=N * K)
    assert torch.equal(triton_dequantize(w, dtype), w.dequantize(dtype))


@small
@pytest.mark.parametrize("where", HERE)
def test_the_reference_ops_dequantize(where):
    from nextserve.ops.linear import linear

    w = _fp8(33, 200, seed=10)
    x = torch.randn(3, 200, dtype=torch.float64, device=DEV)
    want = torch.nn.functional.linear(x, w.dequantize(torch.float64))
    assert torch.equal(linear(x, w, row_invariant=False), want)
    assert torch.allclose(linear(x, w, row_invariant=True), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_gemv_replays_in_a_cuda_graph():
    from nextserve.ops.triton.gemv import small_m_linear

    w = _fp8(2560, 10240, seed=11)
    x = torch.randn(8, 10240, device="cuda", dtype=torch.bfloat16)
    want = small_m_linear(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = small_m_linear(x, w)
    graph.replay()
    assert torch.equal(out, want)


@needs_cuda
@pytest.mark.gpu
def test_fp8_codes_by_bit_moves_are_triton_conversions(monkeypatch) -> None:
    """common.fp8_codes' bit moves give every finite E4M3 code's bf16 value (subnormals, zeros, signs),
    as Triton's own conversion does, and the FP8 GEMV (at decode's row counts) the same bits either way."""
    import triton
    import triton.language as tl

    from nextserve.ops.triton import common
    from nextserve.ops.triton.gemv import small_m_linear

    @triton.jit
    def convert(src, dst, n, FAST: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        w = tl.load(src + offs, mask=offs < n, other=0.0)
        tl.store(dst + offs, common.fp8_codes(w, tl.bfloat16, FAST), mask=offs < n)

    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # the two NaN codes left out
    fast, slow = (torch.empty(len(codes), dtype=torch.bfloat16, device="cuda") for _ in range(2))
    convert[(1,)](codes, fast, len(codes), FAST=True, BLOCK=256)
    convert[(1,)](codes, slow, len(codes), FAST=False, BLOCK=256)
    assert torch.equal(fast.view(torch.int16), slow.view(torch.int16))
    assert torch.equal(fast, codes.to(torch.bfloat16))

    def both(fn):
        on = fn()
        monkeypatch.setattr(common, "FP8_BIT_MOVES", [False])
        off = fn()
        monkeypatch.setattr(common, "FP8_BIT_MOVES", [True])
        return on, off

    w = _fp8(2560, 6144, seed=3)
    for M in (1, 7, 16, 17, 40):
        x = torch.randn(M, 6144, device="cuda", dtype=torch.bfloat16)
        on, off = both(lambda x=x: small_m_linear(x, w))
        assert torch.equal(on, off)
