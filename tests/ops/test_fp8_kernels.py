"""The FP8 paths of the Triton kernels (ops/fp8.py: weights read as FP8, each tile dequantized in
registers): the GEMV (plain, K-split, with the SiLU and stream-mix epilogues) and the grouped experts
(decode and prefill, the shared expert too) give their 16-bit twins' bits on the dequantized weights, rows
stay invariant, and all of it is close to float64 on the dequantized weights. Without a GPU in Triton's
interpreter (float32 / float16); on a GPU in bfloat16 at real widths too."""

from __future__ import annotations

import pytest
import torch
from triton_interp import DEV, INTERPRET, small

from nextserve.ops.fp8 import Fp8Weight, quantize
from nextserve.ops.moe import _experts_by_row, route

DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _fp8(*shape: int, seed: int) -> Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) / shape[-1] ** 0.5
    q, s = quantize(w)
    return Fp8Weight(q.to(DEV), s.to(DEV))


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


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
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,splits", GEMV)
def test_fp8_gemv_is_the_16_bit_kernel_on_dequantized_weights(dtype, N, K, splits):
    from nextserve.ops.triton.gemv import small_m_linear

    w = _fp8(N, K, seed=N + K)
    x = torch.randn(20, K, generator=torch.Generator().manual_seed(1)).to(device=DEV, dtype=dtype)
    got = small_m_linear(x, w, splits=splits)
    assert torch.equal(got, small_m_linear(x, w.dequantize(dtype), splits=splits))
    assert _rel(got, torch.nn.functional.linear(x.double(), w.dequantize(torch.float64))) < TOL[dtype]
    for m in (1, 3, 17):
        assert torch.equal(small_m_linear(x[:m].clone(), w, splits=splits), got[:m]), m


@small
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_gemv_epilogues(dtype):
    from nextserve.ops.triton.gemv import small_m_linear, small_m_linear_mix

    n, hidden, r = 4, 64, 48
    down = _fp8(r + n, n * hidden, seed=3)
    xn = torch.randn(5, n * hidden).to(device=DEV, dtype=dtype)
    plain = down.dequantize(dtype)
    a = small_m_linear(xn, down, silu_cols=r, silu_scale=1 / n)
    assert torch.equal(a, small_m_linear(xn, plain, silu_cols=r, silu_scale=1 / n))
    up = _fp8(n * hidden, r, seed=4)
    act = a[:, :r].contiguous()
    u = small_m_linear_mix(act, up, xn, n, hidden)
    assert u is not None and torch.equal(u, small_m_linear_mix(act, up.dequantize(dtype), xn, n, hidden))


@small
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_experts_are_the_16_bit_kernels_on_dequantized_weights(dtype):
    from nextserve.ops.triton.moe_grouped import grouped_decode_experts, grouped_experts

    E, H, I, k = (6, 256, 128, 2) if INTERPRET else (64, 2560, 640, 10)
    gu, dn = _fp8(E, 2 * I, H, seed=5), _fp8(E, H, I, seed=6)
    sgu, sdn = _fp8(2 * I, H, seed=7), _fp8(H, I, seed=8)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(12, H, generator=g).to(device=DEV, dtype=dtype)
    logits = torch.randn(12, E + 1, generator=g).to(device=DEV, dtype=dtype)
    w, ids = route(logits, k, True, shared=True)
    deq = [t.dequantize(dtype) for t in (gu, dn, sgu, sdn)]
    got = grouped_decode_experts(x, w, ids, gu, dn, shared=(sgu, sdn))
    assert torch.equal(got, grouped_decode_experts(x, w, ids, deq[0], deq[1], shared=(deq[2], deq[3])))
    for m in (1, 5):  # row invariance
        part = grouped_decode_experts(
            x[:m].clone(), w[:m].clone(), ids[:m].clone(), gu, dn, shared=(sgu, sdn)
        )
        assert torch.equal(part, got[:m]), m
    f64 = [t.dequantize(torch.float64) for t in (gu, dn, sgu, sdn)]
    ref = _experts_by_row(x.double(), w.double(), ids, f64[0], f64[1], (f64[2], f64[3]))
    assert _rel(got, ref) < TOL[dtype] * 4
    w2, ids2 = route(logits[:, :E], k, True)
    pre = grouped_experts(x, w2, ids2, gu, dn)
    assert torch.equal(pre, grouped_experts(x, w2, ids2, deq[0], deq[1]))


@small
def test_the_reference_ops_dequantize():
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
