"""The small gating kernels (ops/triton/gates.py, in Triton's interpreter without a GPU) against their
torch references (gdn_gates, silu_mul, sigmoid_gate), on column slices of a stacked projection as the
model passes them, and row invariance (C1)."""

import pytest
import torch
import torch.nn.functional as F

from nextserve.ops.gdn import gdn_gates
from nextserve.ops.pointwise import sigmoid_gate, silu_mul
from nextserve.ops.triton.gates import triton_gdn_gates, triton_sigmoid_gate, triton_silu_mul

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape, (got.dtype, ref.dtype, got.shape, ref.shape)
    torch.testing.assert_close(got.float().cpu(), ref.float().cpu(), rtol=tol, atol=tol)


def _rows_invariant(fn, *ts: torch.Tensor) -> None:
    full = fn(*ts)
    full = full if isinstance(full, tuple) else (full,)
    for i in range(ts[0].shape[0]):
        alone = fn(*(t[i : i + 1] for t in ts))
        alone = alone if isinstance(alone, tuple) else (alone,)
        assert all(torch.equal(a[0], f[i]) for a, f in zip(alone, full, strict=True)), f"row {i}"


def _stack(T: int, widths: list[int], dtype: torch.dtype, seed: int, scale: float = 3.0, device="cpu"):
    """Column slices of one [T, sum(widths)] tensor, as `project` returns them."""
    full = (torch.randn(T, sum(widths), generator=_gen(seed)) * scale).to(dtype).to(device)
    return full.split(widths, dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_gates(dtype: torch.dtype) -> None:
    hv = 6
    _, b, a = _stack(5, [7, hv, hv], dtype, seed=1, scale=8.0)  # a spans softplus' threshold (20) too
    a = a.clone()
    a[0, :3] = torch.tensor([25.0, -30.0, 19.5]).to(dtype)
    a_log = torch.randn(hv, generator=_gen(2)).to(dtype)
    dt_bias = torch.randn(hv, generator=_gen(3)).to(dtype)
    g, beta = triton_gdn_gates(b, a, a_log, dt_bias)
    g_ref, beta_ref = gdn_gates(b, a, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    _close(g, g_ref, 1e-5)
    _close(beta, beta_ref, TOL[dtype])
    _rows_invariant(lambda p, q: triton_gdn_gates(p, q, a_log, dt_bias), b, a)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    g, u, _ = _stack(4, [1100, 1100, 3], dtype, seed=4)  # two blocks, masked
    _close(triton_silu_mul(g, u), F.silu(g) * u, TOL[dtype] * 4)
    _rows_invariant(triton_silu_mul, g, u)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_gate", [False, True])
@pytest.mark.parametrize("add", [False, True])
def test_sigmoid_gate(dtype: torch.dtype, row_gate: bool, add: bool) -> None:
    x, gate, r = _stack(5, [300, 1 if row_gate else 300, 300], dtype, seed=5)
    res = r if add else None
    ref = x * torch.sigmoid(gate)
    ref = ref if res is None else res + ref
    _close(triton_sigmoid_gate(x, gate, res), ref, TOL[dtype] * 4)
    fn = (lambda p, q, s: triton_sigmoid_gate(p, q, s)) if add else (lambda p, q: triton_sigmoid_gate(p, q))
    _rows_invariant(fn, *((x, gate, r) if add else (x, gate)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gate_head_split_gate_read_in_place(dtype: torch.dtype) -> None:
    """QSA's gate: the second half of each head's [q | gate] columns, [T, heads, D] with rows and heads
    strided; the kernel reads it in place, with the contiguous gate's bits."""
    T, heads, D = 5, 3, 40
    qg = torch.randn(T, heads, 2 * D, generator=_gen(14)).to(dtype)
    x = torch.randn(T, heads * D, generator=_gen(15)).to(dtype)
    gate = qg[..., D:]
    got = triton_sigmoid_gate(x, gate)
    assert torch.equal(got, triton_sigmoid_gate(x, gate.reshape(T, heads * D)))
    _close(got, x * torch.sigmoid(gate.reshape(T, -1)), TOL[dtype] * 4)
    assert torch.equal(
        sigmoid_gate(x.double(), gate.double()), x.double() * torch.sigmoid(gate.double()).flatten(1)
    )
    _rows_invariant(lambda p, q: triton_sigmoid_gate(p, q), x, gate)


def test_cpu_references_are_the_former_code() -> None:
    """On the CPU the ops are the torch code they replaced in the model, bit for bit."""
    b, a, g, u, sg = _stack(3, [5, 5, 8, 8, 1], torch.bfloat16, seed=6)
    a_log, dt_bias = torch.randn(5, generator=_gen(7)), torch.randn(5, generator=_gen(8)).bfloat16()
    g_ref = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    got_g, got_beta = gdn_gates(b, a, a_log, dt_bias, True)
    assert torch.equal(got_g, g_ref) and torch.equal(got_beta, torch.sigmoid(b))
    assert torch.equal(silu_mul(g, u, True), F.silu(g) * u)
    assert torch.equal(sigmoid_gate(u, sg, g, True), g + torch.sigmoid(sg) * u)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_gates(dtype: torch.dtype) -> None:
    """Real widths on CUDA: against the CPU references, and row-invariant."""
    T = 33
    b, a = _stack(T, [48, 48], dtype, seed=9, scale=8.0, device="cuda")
    a_log = torch.randn(48, generator=_gen(10)).cuda()
    dt_bias = torch.randn(48, generator=_gen(11)).to(dtype).cuda()
    g, beta = gdn_gates(b, a, a_log, dt_bias, True)
    g_ref, beta_ref = gdn_gates(b.cpu(), a.cpu(), a_log.cpu(), dt_bias.cpu(), True)
    _close(g, g_ref, 1e-5)
    _close(beta, beta_ref, TOL[dtype])
    _rows_invariant(lambda p, q: gdn_gates(p, q, a_log, dt_bias, True), b, a)
    gg, uu, x, sg = _stack(T, [640, 640, 2560, 1], dtype, seed=12, device="cuda")
    r = torch.randn(T, 2560, generator=_gen(13)).to(dtype).cuda()
    _close(silu_mul(gg, uu, True), silu_mul(gg.cpu(), uu.cpu(), True), TOL[dtype] * 4)
    _close(sigmoid_gate(x, sg, r, True), sigmoid_gate(x.cpu(), sg.cpu(), r.cpu(), True), TOL[dtype] * 4)
    _rows_invariant(lambda p, q: silu_mul(p, q, True), gg, uu)
    _rows_invariant(lambda p, q, s: sigmoid_gate(p, q, s, True), x, sg, r)
