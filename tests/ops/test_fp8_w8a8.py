"""Prefill chunks' FP8 projections as W8A8 (ops/triton/fp8_gemm.py): the activations' per-token, per-128
quantization gives the reference's bits (ops/fp8.py `quantize_activations`: codes and scales), its E4M3
rounding is torch's (ties to even) at every binade, the GEMM is close to the reference's block-scaled sum
and keeps rows invariant, the reference is the float64 product within the quantization's error, and
`linear` routes 16-bit prefill chunks there (decode rows keep the GEMV)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton_interp import DEV, INTERPRET, needs_cuda, row_independent_dot, small  # noqa: F401

from nextserve.ops.fp8 import FP8, Fp8Weight, quantize, quantize_activations, w8a8_linear
from nextserve.ops.triton.fp8_gemm import _round_e4m3

HERE = [pytest.param("here", marks=[] if INTERPRET else [pytest.mark.gpu])]
DTYPES = [torch.bfloat16, torch.float16]
SHAPES = [(5, 200, 300), (33, 256, 640), (17, 129, 128), (130, 384, 257)]  # T, N, K
if not INTERPRET:
    SHAPES += [(4096, 10240, 2560), (1000, 2560, 6144), (700, 640, 2560)]


def _fp8(n: int, k: int, seed: int) -> Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    q, s = quantize(torch.randn(n, k, generator=g) / k**0.5)
    return Fp8Weight(q.to(DEV), s.to(DEV))


def _x(t: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.logspace(-3, 2, t)[:, None]  # rows of every magnitude
    x[min(1, t - 1), : min(k, 128)] = 0  # an all-zero group: scale 1, codes 0
    return x.to(dtype).to(DEV)


def _codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@triton.jit
def convert(v_ptr, q_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + i, mask=i < n)
    tl.store(q_ptr + i, _round_e4m3(v).to(q_ptr.dtype.element_ty), mask=i < n)


def test_reference_quantization_is_within_half_a_step():
    x = _x(9, 300, torch.float32, seed=1).cpu()
    q, s = quantize_activations(x)
    assert q.dtype == FP8 and s.shape == (9, 3)
    assert torch.equal(s[1, 0], torch.tensor(1.0)) and not _codes(q[1, :128]).any()
    back = q.float() * s.repeat_interleave(128, dim=1)[:, :300]
    # E4M3 keeps 3 mantissa bits: within 2^-4 of the value (relative), or a subnormal step 2^-10 * s
    err = (back - x).abs()
    bound = torch.maximum(x.abs() * 2**-4, 2**-10 * s.repeat_interleave(128, dim=1)[:, :300])
    assert (err <= bound * 1.0001).all()
    assert (q.float().abs().amax(dim=1) == 448).all()  # every row's largest value maps to 448 exactly


@small
@pytest.mark.parametrize("where", HERE)
def test_e4m3_rounding_is_torch_conversion_at_every_binade(where):
    """Every E4M3 value, the midpoints between neighbours (ties go to the even code) and values just off
    them, through the kernel's rounding and conversion, against torch's float32 -> float8_e4m3fn."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()  # [253] every finite value, both signs and zero
    mids = (grid[1:] + grid[:-1]) / 2
    v = torch.cat([grid, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))])
    v = v[v.abs() <= 448].contiguous().to(DEV)
    got = torch.empty(v.shape, dtype=FP8, device=DEV)
    convert[(triton.cdiv(v.numel(), 256),)](v, got, v.numel(), BLOCK=256)
    assert torch.equal(_codes(got), _codes(v.to(FP8)))


@small
@pytest.mark.parametrize("where", HERE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N,K", SHAPES)
def test_kernel_quantization_is_the_reference(where, dtype, T, N, K):
    from nextserve.ops.triton.fp8_gemm import quantize_activations as kernel

    x = _x(T, K, dtype, seed=T + K)
    q, s = kernel(x)
    want_q, want_s = quantize_activations(x)
    assert torch.equal(_codes(q), _codes(want_q)) and torch.equal(s, want_s)


@small
@pytest.mark.parametrize("where", HERE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N,K", SHAPES)
def test_w8a8_gemm_is_close_to_the_reference(where, dtype, T, N, K):
    """Each output within one rounding of the dtype (plus the float32 sum's order) of the reference, and the
    reference within the activations' quantization error of the float64 product on the FP8 weights."""
    from nextserve.ops.triton.fp8_gemm import w8a8_linear as kernel

    x, w = _x(T, K, dtype, seed=T * K), _fp8(N, K, seed=N + K)
    got, want = kernel(x, w), w8a8_linear(x, w)
    assert got.dtype == dtype and got.shape == (T, N)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    scale = want.float().abs().amax(dim=1, keepdim=True) + 1e-30  # per row: rows span five decades
    assert ((got.float() - want.float()).abs() / scale).max() <= 2 * ulp
    exact = x.double() @ w.dequantize(torch.float64).T
    rel = ((want.double() - exact).norm(dim=1) / exact.norm(dim=1).clamp_min(1e-30)).max()
    assert rel < 0.06  # E4M3 activations: about 2^-5 relative a value, averaged over K


@small
@pytest.mark.parametrize("where", HERE)
@pytest.mark.usefixtures("row_independent_dot")
def test_w8a8_rows_are_invariant(where):
    """A row's bits do not depend on the rows beside it (fixed tiles; a row's codes and scales its own)."""
    from nextserve.ops.triton.fp8_gemm import w8a8_linear as kernel

    x, w = _x(40, 384, torch.bfloat16, seed=3), _fp8(200, 384, seed=4)
    whole = kernel(x, w)
    for rows in (slice(0, 1), slice(7, 9), slice(13, 40)):
        assert torch.equal(kernel(x[rows].clone(), w), whole[rows])


def test_w8a8_applies_to_16_bit_prefill_chunks_only(monkeypatch):
    from nextserve.ops.triton import fp8_gemm

    monkeypatch.setattr(fp8_gemm, "PREFILL_W8A8", True)

    w = _fp8(256, 256, seed=5)
    cpu_w = Fp8Weight(w.q.cpu(), w.scale.cpu())
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    assert fp8_gemm.w8a8_applies(x, cpu_w)
    assert not fp8_gemm.w8a8_applies(x.float(), cpu_w)  # float32 activations keep the dequantized GEMM
    stacked = Fp8Weight(cpu_w.q[None], cpu_w.scale[None])
    assert not fp8_gemm.w8a8_applies(x, stacked)
    monkeypatch.setattr(fp8_gemm, "PREFILL_W8A8", False)
    assert not fp8_gemm.w8a8_applies(x, cpu_w)


@pytest.mark.gpu
@needs_cuda
def test_linear_runs_16_bit_fp8_prefill_chunks_as_w8a8(monkeypatch):
    """On a card with FP8 MMAs and PREFILL_W8A8 on, linear() sends a bf16 prefill chunk's FP8 projection to
    the W8A8 kernel and decode rows (row_invariant) to the GEMV, whose 16-bit activations stay 16-bit."""
    from nextserve.ops.linear import linear
    from nextserve.ops.triton import fp8_gemm
    from nextserve.ops.triton.gemv import small_m_linear

    monkeypatch.setattr(fp8_gemm, "PREFILL_W8A8", True)

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 MMAs on this card")
    w = _fp8(640, 2560, seed=11)
    x = torch.randn(700, 2560, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(linear(x, w, row_invariant=False), fp8_gemm.w8a8_linear(x, w))
    assert torch.equal(linear(x[:3], w, row_invariant=True), small_m_linear(x[:3], w))


@small
@pytest.mark.parametrize("where", HERE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a8_prefill_experts_are_close_to_the_reference(where, dtype, monkeypatch):
    """With PREFILL_EXPERTS_W8A8 the grouped prefill experts on FP8 weights run W8A8 (x and the act rows
    quantized per row and 128 columns): close to the per-expert W8A8 reference (ops/moe.py
    `_experts_by_expert(w8a8=True)`) with the shared expert and the wide blocks; on a GPU the chunks of
    `experts_of_chunks` (one grouped call) keep the bits each has alone."""
    from nextserve.ops.moe import _experts_by_expert, experts_of_chunks, route
    from nextserve.ops.triton import moe_grouped
    from nextserve.ops.triton.moe_grouped import grouped_experts

    monkeypatch.setattr(moe_grouped, "PREFILL_EXPERTS_W8A8", True)

    E, H, I, k = (6, 256, 256, 2) if INTERPRET else (64, 2560, 640, 10)
    gu, dn = _stack(E, 2 * I, H, seed=5), _stack(E, H, I, seed=6)
    sgu, sdn = _fp8(2 * I, H, seed=7), _fp8(H, I, seed=8)
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(24, H, generator=g) * 4).to(device=DEV, dtype=dtype)
    logits = torch.randn(24, E + 1, generator=g).to(device=DEV, dtype=dtype)
    w, ids = route(logits, k, True, shared=True)
    want = _experts_by_expert(x, w, ids, gu, dn, (sgu, sdn), w8a8=True)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    for block_m in (None, 128):
        got = grouped_experts(x, w, ids, gu, dn, block_m=block_m, shared=(sgu, sdn))
        assert ((got.float() - want.float()).abs().max() / want.float().abs().max()) <= 8 * ulp
    if INTERPRET:  # (experts_of_chunks runs one grouped call on CUDA only)
        return
    w2, ids2 = route(logits[:, :E], k, True)
    alone = [grouped_experts(x[i : i + 8], w2[i : i + 8], ids2[i : i + 8], gu, dn) for i in (0, 8, 16)]
    parts = [slice(i, i + 8) for i in (0, 8, 16)]
    together = experts_of_chunks(
        [x[s] for s in parts], [w2[s] for s in parts], [ids2[s] for s in parts], gu, dn
    )
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))


def _stack(e: int, n: int, k: int, seed: int) -> Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    q, s = quantize(torch.randn(e, n, k, generator=g) / k**0.5)
    return Fp8Weight(q.to(DEV), s.to(DEV))


@small
@pytest.mark.parametrize("where", HERE)
def test_scales_by_column_are_the_same_scales(where):
    from nextserve.ops.triton.fp8_gemm import quantize_activations as kernel

    x = _x(37, 300, torch.bfloat16, seed=8)
    q, s = kernel(x, scales_by_column=True)
    want_q, want_s = quantize_activations(x)
    assert s.stride() == (1, 37) and torch.equal(s, want_s) and torch.equal(_codes(q), _codes(want_q))


@pytest.mark.gpu
@needs_cuda
def test_cublas_block_scaled_gemm_is_close_to_the_reference(monkeypatch):
    """W8A8_GEMM = "cublas" (torch's scaled_mm with 1x128 x 128x128 scales) where this torch and card have
    it: close to the reference as the Triton GEMM is."""
    from nextserve.ops.triton import fp8_gemm

    if not fp8_gemm._cublas_block_fp8(torch.device("cuda")):
        pytest.skip("no block-scaled scaled_mm on this card or torch build")
    monkeypatch.setattr(fp8_gemm, "W8A8_GEMM", "cublas")
    for T, N, K in [(700, 640, 2560), (4096, 2560, 6144), (33, 384, 640)]:
        x, w = _x(T, K, torch.bfloat16, seed=T), _fp8(N, K, seed=N)
        got, want = fp8_gemm.w8a8_linear(x, w), w8a8_linear(x, w)
        scale = want.float().abs().amax(dim=1, keepdim=True) + 1e-30
        assert ((got.float() - want.float()).abs() / scale).max() <= 2**-6
