"""Hyper-connection ops: the CPU path of GatedResidual is the former torch code bit for bit; the Triton
kernels (ops/triton/hyper.py, in the interpreter without a GPU) match the references and are row-invariant."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from triton_interp import row_independent_dot  # noqa: F401

from nextserve.model.hyper import GatedResidual
from nextserve.ops.hyper import down_silu, inject, mix_streams, scaled_silu
from nextserve.ops.linear import linear
from nextserve.ops.norms import rms_norm
from nextserve.ops.pointwise import rowwise
from nextserve.ops.triton.hyper import triton_inject, triton_mix_streams, triton_scaled_silu

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}
N, H, R = 4, 48, 8  # CPU sizes; H spans one block, n as the model's


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    torch.testing.assert_close(got.float().cpu(), ref.float().cpu(), rtol=TOL[dtype], atol=TOL[dtype] * scale)


def _rows_invariant(fn, *ts: torch.Tensor) -> None:
    full = fn(*ts)
    for i in range(ts[0].shape[0]):
        assert torch.equal(fn(*(t[i : i + 1] for t in ts))[0], full[i]), f"row {i} alone"
    assert torch.equal(fn(*(t[1:4].clone() for t in ts)), full[1:4]), "rows 1:4"


def _inputs(T: int, n: int, h: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    g = _gen(seed + n * h)
    x = (torch.randn(T, n * h, generator=g) * 2).to(dtype).to(device)  # streams / logits
    xn = torch.randn(T, n * h, generator=g).to(dtype).to(device)
    y = torch.randn(T, h, generator=g).to(dtype).to(device)
    v = (torch.randn(T, n, generator=g) * 3).to(dtype).to(device)
    return x, xn, y, v


# ---- the CPU path is the former torch code ---------------------------------------------------------
def _module(n: int, h: int, r: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> GatedResidual:
    cfg = SimpleNamespace(hc_count=n, hidden_size=h, rms_norm_eps=1e-6, hc_hidden=n * h, hc_lowrank=r)
    m = GatedResidual(cfg)
    g = _gen(seed)
    for p in m.parameters():
        p.data = (torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5).to(dtype).to(device)
    return m


def _former_forward(m: GatedResidual, x: torch.Tensor, block, ri: bool) -> torch.Tensor:
    """GatedResidual.forward before the fused ops (verbatim)."""
    xn = rms_norm(x, m.hc_norm.weight, m.eps, group=m.hidden)
    a = rowwise(F.silu, linear(xn, m.input_mix_weight_down.weight, ri) / m.n, ri)
    gate = rowwise(torch.sigmoid, linear(a, m.input_mix_weight_up.weight, ri), ri)
    u = (gate.unflatten(-1, (m.n, m.hidden)) * xn.unflatten(-1, (m.n, m.hidden))).mean(dim=-2)
    inj = 2 * rowwise(torch.sigmoid, linear(xn, m.block_inject_weight.weight, ri) / m.n, ri)
    y = block(u)
    return x + (y.unsqueeze(-2) * inj.unsqueeze(-1)).flatten(-2)


@pytest.mark.parametrize("ri", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_gated_residual_is_the_former_code(dtype: torch.dtype, ri: bool) -> None:
    m = _module(N, H, R, dtype)
    x = torch.randn(7, N * H, generator=_gen(1)).to(dtype)
    w = torch.randn(H, H, generator=_gen(2)).to(dtype) / H**0.5

    def block(u):
        return torch.tanh(u @ w)

    assert torch.equal(m(x, block, ri), _former_forward(m, x, block, ri))


# ---- the kernels in Triton's interpreter -------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scaled_silu(dtype: torch.dtype) -> None:
    v = (torch.randn(6, 37, generator=_gen(3)) * 4).to(dtype)
    _close(triton_scaled_silu(v, N), scaled_silu(v, N), dtype)
    _rows_invariant(lambda t: triton_scaled_silu(t, N), v)


@pytest.mark.parametrize("sigmoid", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("nh", [(N, H), (3, 1100)])  # (n, H): H spanning two blocks, masked; odd n
def test_mix_streams(nh, dtype: torch.dtype, sigmoid: bool) -> None:
    n, h = nh
    logits, xn, _, _ = _inputs(6, n, h, dtype)
    got = triton_mix_streams(logits, xn, n, h, sigmoid=sigmoid)
    if sigmoid:
        ref = mix_streams(logits, xn, n, h)
    else:
        ref = (logits.unflatten(-1, (n, h)) * xn.unflatten(-1, (n, h))).mean(dim=-2)
    _close(got, ref, dtype, scale=2.0)
    _rows_invariant(lambda a, b: triton_mix_streams(a, b, n, h, sigmoid=sigmoid), logits, xn)


@pytest.mark.parametrize("from_logits", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("nh", [(N, H), (3, 1100)])
def test_inject(nh, dtype: torch.dtype, from_logits: bool) -> None:
    n, h = nh
    x, _, y, v = _inputs(6, n, h, dtype, seed=1)
    got = triton_inject(x, y, v, n, from_logits=from_logits)
    if from_logits:
        ref = inject(x, y, v, n)
    else:
        ref = x + (y.unsqueeze(-2) * v.unsqueeze(-1)).flatten(-2)
    _close(got, ref, dtype, scale=4.0)
    _rows_invariant(lambda a, b, c: triton_inject(a, b, c, n, from_logits=from_logits), x, y, v)


def test_down_silu_reference() -> None:
    """The CPU path: silu(y / n) on the first `rank` columns, the rest as projected."""
    x = torch.randn(3, 16, generator=_gen(5))
    w = torch.randn(10, 16, generator=_gen(6))
    y = linear(x, w, True)
    got = down_silu(x, w, 6, N, True)
    assert torch.equal(got[:, :6], scaled_silu(y[:, :6], N, True)) and torch.equal(got[:, 6:], y[:, 6:])
    assert torch.equal(down_silu(x, w, 10, N, True), scaled_silu(y, N, True))


def test_strided_inputs() -> None:
    """Row-strided views (as a fused projection's split gives) read the same as contiguous copies."""
    logits, xn, y, v = _inputs(5, N, H, torch.float32, seed=2)
    wide = torch.cat([logits, logits], dim=-1)[:, N * H :]
    assert torch.equal(triton_mix_streams(wide, xn, N, H, True), triton_mix_streams(logits, xn, N, H, True))
    wv = torch.cat([v, v], dim=-1)[:, N:]
    assert torch.equal(triton_inject(xn, y, wv, N, True), triton_inject(xn, y, v, N, True))


# ---- CUDA: bfloat16, the module, graph capture -------------------------------------------------------
@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernels(dtype: torch.dtype) -> None:
    n, h, T = 4, 2560, 40
    x, xn, y, v = _inputs(T, n, h, dtype, seed=3, device="cuda")
    a = (torch.randn(T, 320, generator=_gen(4)) * 4).to(dtype).cuda()
    cpu = [t.cpu() for t in (x, xn, y, v, a)]
    _close(scaled_silu(a, n, True), scaled_silu(cpu[4], n, True), dtype)
    _close(mix_streams(x, xn, n, h, True), mix_streams(cpu[0], cpu[1], n, h, True), dtype, scale=2.0)
    _close(inject(x, y, v, n, True), inject(cpu[0], cpu[2], cpu[3], n, True), dtype, scale=8.0)
    _rows_invariant(lambda t: scaled_silu(t, n, True), a)
    _rows_invariant(lambda p, q: mix_streams(p, q, n, h, True), x, xn)
    _rows_invariant(lambda p, q, r: inject(p, q, r, n, True), x, y, v)
    # the fused decode ops give the bits of the launches they replace
    w_down = (torch.randn(324, n * h, generator=_gen(8)) / (n * h) ** 0.5).to(dtype).cuda()
    w_up = (torch.randn(n * h, 320, generator=_gen(9)) / 320**0.5).to(dtype).cuda()
    down = linear(xn, w_down, True)
    fused = down_silu(xn, w_down, 320, n, True)
    assert torch.equal(fused[:, 320:], down[:, 320:])
    assert torch.equal(fused[:, :320], scaled_silu(down[:, :320], n, True))
    # the up projection reads the activation's column slice in place: the bits of a contiguous copy
    assert torch.equal(linear(fused[:, :320], w_up, True), linear(fused[:, :320].contiguous(), w_up, True))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_gated_residual(dtype: torch.dtype) -> None:
    """The module on CUDA (norm, GEMVs, fused ops) against its CPU self, and its rows against themselves."""
    n, h, r, T = 4, 2560, 320, 24
    m_cpu = _module(n, h, r, torch.float32, seed=5)
    m = _module(n, h, r, dtype, seed=5, device="cuda")
    x = torch.randn(T, n * h, generator=_gen(6))
    w = torch.randn(h, h, generator=_gen(7)) / h**0.5
    wc = w.to(dtype).cuda()

    def block(u):
        return torch.tanh(u @ w.t()) if u.device.type == "cpu" else torch.tanh(linear(u, wc, True))

    got = m(x.to(dtype).cuda(), block, True)
    ref = m_cpu(x.to(dtype).float(), block, True)
    rel = ((got.double().cpu() - ref.double()).norm() / ref.double().norm()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 1e-2), rel
    xc = x.to(dtype).cuda()
    _rows_invariant(lambda t: m(t, block, True), xc)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = m(xc, block, True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)
    m.fuse()
    chunk = m(x.to(dtype).cuda(), block, False)  # a prefill chunk: one GEMM over the padded stack
    rel = ((chunk.double().cpu() - ref.double()).norm() / ref.double().norm()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 1e-2), rel


@pytest.mark.parametrize("ri", [False, True])
def test_cpu_fused_down_inject_is_unfused(ri: bool) -> None:
    """Stacking the mixer's down and inject projections (fuse) changes no bit on the CPU."""
    m = _module(N, H, R, torch.bfloat16, seed=8)
    x = torch.randn(5, N * H, generator=_gen(9)).bfloat16()

    def block(u):
        return u * 0.5

    before = m(x, block, ri)
    m.fuse()
    assert m.in_proj is not None and m.in_proj.shape == (-(-(R + N) // 8) * 8, N * H)  # padded rows
    assert not m.in_proj[R + N :].any()
    assert torch.equal(m(x, block, ri), before)
