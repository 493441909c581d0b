"""The Triton RMS norms (ops/triton/norms.py) against their torch references (ops/norms.py): on the CPU
through Triton's interpreter (float32/float16; bfloat16 is broken there), on CUDA in bfloat16 too."""

import pytest
import torch

from nextserve.ops.norms import rms_norm, rms_norm_gated
from nextserve.ops.triton.norms import _rows, triton_rms_norm, triton_rms_norm_gated

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}
EPS = 1e-6
# (leading dims, D, group): one slice per row; groups (hc_norm's per-stream norm); heads (q/k norms);
# a slice longer than a tile, not a power of two; slices shorter than a tile, several per program.
SHAPES = [((5,), 320, None), ((5,), 320, 80), ((5, 3), 48, None), ((4,), 1100, None), ((6,), 120, 24),
          ((2, 3, 4), 40, 8)]  # fmt: skip


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    rel = TOL[dtype]
    torch.testing.assert_close(got.float().cpu(), ref.float().cpu(), rtol=rel, atol=rel)


def _rows_invariant(fn, *ts: torch.Tensor) -> None:
    """T rows in one call == each row alone == a sub-batch, bit for bit."""
    full = fn(*ts)
    for i in range(ts[0].shape[0]):
        assert torch.equal(fn(*(t[i : i + 1] for t in ts))[0], full[i]), f"row {i} alone"
    assert torch.equal(fn(*(t[1:4].clone() for t in ts)), full[1:4]), "rows 1:4"


def _norm_inputs(lead, D, dtype, seed, device="cpu"):
    g = _gen(seed + D)
    x = (torch.randn(*lead, D, generator=g) * 3).to(dtype).to(device)
    w = (torch.randn(D, generator=g) * 0.5).to(dtype).to(device)
    return x, w


# ---- CPU: the kernels in Triton's interpreter -----------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference_and_rows_are_invariant(shape, dtype: torch.dtype) -> None:
    lead, D, group = shape
    x, w = _norm_inputs(lead, D, dtype, seed=1)
    got = triton_rms_norm(x, w, EPS, group)
    _close(got, rms_norm(x, w, EPS, group), dtype)
    _rows_invariant(lambda t: triton_rms_norm(t, w, EPS, group), x)


def test_rms_norm_strided_view() -> None:
    """q as the model slices it: [T, heads, 2D] -> [..., :D] (rows strided, last dim contiguous)."""
    g = _gen(3)
    qg = torch.randn(4, 3, 2 * 32, generator=g)
    w = torch.randn(32, generator=g)
    q = qg[..., :32]
    got = triton_rms_norm(q, w, EPS)
    assert got.is_contiguous()
    assert _rel(got, rms_norm(q, w, EPS)) < 1e-6
    assert torch.equal(got, triton_rms_norm(q.contiguous(), w, EPS))
    assert _rows(q).data_ptr() == q.data_ptr()  # read in place: the [T * heads, D] reshape would copy


@pytest.mark.parametrize("act", ["sigmoid", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_gated_matches_reference_and_rows_are_invariant(dtype: torch.dtype, act: str) -> None:
    g = _gen(5)
    T, Hv, dv = 5, 3, 40
    x = (torch.randn(T, Hv, dv, generator=g) * 2).to(dtype)
    z = torch.randn(T, 2 * Hv * dv, generator=g).to(dtype)[:, Hv * dv :].reshape(T, Hv, dv)  # a split view
    w = torch.randn(dv, generator=g).to(dtype)
    got = triton_rms_norm_gated(x, z, w, EPS, act)
    assert _rows(z).data_ptr() == z.data_ptr()  # the gate read in place
    _close(got, rms_norm_gated(x, z, w, EPS, act), dtype)
    _rows_invariant(lambda a, b: triton_rms_norm_gated(a, b, w, EPS, act), x, z)


def test_rms_norm_gated_float32_weight_keeps_float32_product() -> None:
    """weight float32, x float16: the reference's `weight * normed.to(dtype)` is float32 (no rounding)."""
    g = _gen(6)
    x = torch.randn(3, 2, 64, generator=g).half()
    z = torch.randn(3, 2, 64, generator=g).half()
    w = torch.randn(64, generator=g)
    _close(
        triton_rms_norm_gated(x, z, w, EPS, "sigmoid"), rms_norm_gated(x, z, w, EPS, "sigmoid"), torch.float16
    )


def test_empty_rows() -> None:
    x, w = _norm_inputs((0,), 64, torch.float32, seed=0)
    assert triton_rms_norm(x, w, EPS).shape == (0, 64)
    assert triton_rms_norm_gated(x, x, w, EPS, "silu").shape == (0, 64)


# ---- CUDA: bfloat16, the dispatch in ops/norms.py, graph capture ----------------------------------
@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "shape", [((40,), 10240, 2560), ((40,), 10240, None), ((40, 16), 256, None), ((40, 8), 128, None)]
)
def test_cuda_rms_norm(shape, dtype: torch.dtype) -> None:
    lead, D, group = shape
    x, w = _norm_inputs(lead, D, dtype, seed=2, device="cuda")
    got = rms_norm(x, w, EPS, group)  # dispatches to the kernel
    assert torch.equal(got, triton_rms_norm(x, w, EPS, group))
    _close(got, rms_norm(x.cpu(), w.cpu(), EPS, group), dtype)
    _rows_invariant(lambda t: rms_norm(t, w, EPS, group), x)
    for m in (1, 2, 5, 16, 17, 33):
        assert torch.equal(rms_norm(x[:m].clone(), w, EPS, group), got[:m]), m


@gpu
@needs_cuda
@pytest.mark.parametrize("act", ["sigmoid", "silu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_rms_norm_gated(dtype: torch.dtype, act: str) -> None:
    g = torch.Generator().manual_seed(9)
    T, Hv, dv = 40, 32, 128
    x = torch.randn(T, Hv, dv, generator=g).to(dtype).cuda()
    z = torch.randn(T, 2 * Hv * dv, generator=g).to(dtype).cuda()[:, Hv * dv :].reshape(T, Hv, dv)
    w = torch.randn(dv, generator=g).to(dtype).cuda()
    got = rms_norm_gated(x, z, w, EPS, act, True)
    _close(got, rms_norm_gated(x.cpu(), z.cpu(), w.cpu(), EPS, act, True), dtype)
    _rows_invariant(lambda a, b: rms_norm_gated(a, b, w, EPS, act, True), x, z)


@gpu
@needs_cuda
def test_cuda_graph_capture() -> None:
    x, w = _norm_inputs((4,), 10240, torch.bfloat16, seed=4, device="cuda")
    z = torch.randn_like(x)
    eager = (
        rms_norm(x, w, EPS, 2560),
        rms_norm_gated(x.view(4, 80, 128), z.view(4, 80, 128), w[:128], EPS, "sigmoid"),
    )
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = (
            rms_norm(x, w, EPS, 2560),
            rms_norm_gated(x.view(4, 80, 128), z.view(4, 80, 128), w[:128], EPS, "sigmoid"),
        )
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, eager, strict=True))
