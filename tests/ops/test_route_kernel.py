"""The Triton MoE router (ops/triton/route.py) against the CPU path of ops/moe.route: on the CPU through
Triton's interpreter (float32/float16; bfloat16 is broken there), on CUDA in bfloat16 too."""

import pytest
import torch

from nextserve.ops.moe import route
from nextserve.ops.triton.route import triton_route

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# (E, k): a toy router; the real one (512 experts, top 10)
SIZES = [(8, 2), (512, 10)]


def _logits(T: int, E: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """Random logits on the bfloat16 grid whatever the dtype: distinct logits are then far apart next to
    the rounding of exp (so the ids compare exactly between implementations), and exact ties, which the
    rule decides, are common."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, E, generator=g) * 2).to(torch.bfloat16).to(dtype).to(device)


def _check_vs_reference(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = triton_route(logits, k, normalize)
    ref_w, ref_ids = route(logits.cpu(), k, normalize)
    assert w.dtype == logits.dtype and w.shape == (logits.shape[0], k)
    assert ids.dtype == torch.int64 and ids.shape == (logits.shape[0], k)
    assert torch.equal(ids.cpu(), ref_ids)
    rel = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}[logits.dtype]
    torch.testing.assert_close(w.float().cpu(), ref_w.float(), rtol=rel, atol=1e-6)
    return w, ids


def _rows_invariant(logits: torch.Tensor, k: int, normalize: bool, rows=None) -> None:
    """Each row alone (and a sub-batch) == the same row in the whole call, bit for bit."""
    full_w, full_i = triton_route(logits, k, normalize)
    for r in rows if rows is not None else range(logits.shape[0]):
        w, i = triton_route(logits[r : r + 1].clone(), k, normalize)
        assert torch.equal(w[0], full_w[r]) and torch.equal(i[0], full_i[r]), f"row {r} alone"
    w, i = triton_route(logits[1:3].clone(), k, normalize)
    assert torch.equal(w, full_w[1:3]) and torch.equal(i, full_i[1:3]), "rows 1:3"


# ---- CPU (Triton's interpreter) ---------------------------------------------------------------------
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("size", SIZES)
def test_matches_reference(size, dtype: torch.dtype, normalize: bool) -> None:
    E, k = size
    w, _ = _check_vs_reference(_logits(4, E, dtype, seed=E + k), k, normalize)
    if normalize:
        torch.testing.assert_close(w.float().sum(-1), torch.ones(4), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("size", SIZES)
def test_ties_go_to_the_lower_index(size) -> None:
    E, k = size
    # row 0: all equal; row 1: the top two values each repeated (out of order); row 2: equal logits
    # far below the max, so their probabilities underflow to 0 and tie there too
    x = torch.zeros(3, E)
    x[1, 2 * E // 3] = x[1, E - 1] = 3.0
    x[1, E // 4] = x[1, 1] = x[1, E // 2] = 2.0
    x[2] = -200.0
    x[2, E - 1] = 0.0
    for normalize in (True, False):
        w, ids = _check_vs_reference(x, k, normalize)
        assert ids[0].tolist() == list(range(k))
        assert ids[1, :5].tolist() == [2 * E // 3, E - 1, 1, E // 4, E // 2][:k]
        assert ids[2].tolist() == [E - 1, *range(k - 1)]
        assert torch.all(w[0] == w[0, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("size", SIZES)
def test_shared_expert_column(size, dtype: torch.dtype) -> None:
    """With shared=True the last logit is the shared expert's gate: the top-k of the others as without
    it, then (id E, sigmoid(gate)); the kernel equals the CPU path and its rows are invariant."""
    E, k = size
    logits = _logits(6, E + 1, dtype, seed=E)
    w, ids = triton_route(logits, k, True, shared=True)
    ref_w, ref_ids = route(logits, k, True, shared=True)
    assert w.shape == ids.shape == (6, k + 1) and torch.equal(ids, ref_ids)
    assert torch.equal(ids[:, k], torch.full((6,), E)) and torch.equal(
        ids[:, :k], route(logits[:, :E], k, True)[1]
    )
    rel = {torch.float32: 1e-6, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(w.float(), ref_w.float(), rtol=rel, atol=1e-6)
    assert torch.equal(w[:, :k], triton_route(logits[:, :E].contiguous(), k, True)[0])
    alone = triton_route(logits[3:4].clone(), k, True, shared=True)
    assert torch.equal(alone[0][0], w[3]) and torch.equal(alone[1][0], ids[3])


def test_strided_rows() -> None:
    """The router's logits are a column slice of a fused projection: rows are strided."""
    fused = _logits(3, 8 + 5, torch.float32, seed=3)
    _check_vs_reference(fused[:, 2:10], 2, True)


@pytest.mark.parametrize("size", SIZES)
def test_row_invariance(size) -> None:
    E, k = size
    _rows_invariant(_logits(4, E, torch.float32, seed=7), k, True)
    _rows_invariant(_logits(4, E, torch.float16, seed=8), k, False)


def test_empty_and_row_count_not_specialised() -> None:
    w, ids = triton_route(torch.zeros(0, 8), 2, True)
    assert w.shape == (0, 2) and ids.shape == (0, 2)
    x = _logits(2, 8, torch.float32, seed=1)
    assert torch.equal(triton_route(x[:1], 2, True)[1], triton_route(x, 2, True)[1][:1])


# ---- CUDA: bfloat16 at real sizes, the dispatch in ops/moe.py, graph capture ----------------------
@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 7, 32, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_route(T: int, dtype: torch.dtype) -> None:
    x = _logits(T, 512, dtype, seed=T, device="cuda")
    for normalize in (True, False):
        w, ids = route(x, 10, normalize, True)  # dispatches to the kernel
        assert torch.equal(w, triton_route(x, 10, normalize)[0])
        ref_w, ref_ids = route(x.cpu(), 10, normalize, True)
        assert torch.equal(ids.cpu(), ref_ids)
        rel = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(w.float().cpu(), ref_w.float(), rtol=rel, atol=1e-6)
    _rows_invariant(x, 10, True, rows=range(min(T, 40)))
    xs = torch.cat([x, x[:, :1] * 0.5], dim=1)  # the shared expert's gate logit last
    sw, sids = route(xs, 10, True, True, shared=True)
    ref_w, ref_ids = route(xs.cpu(), 10, True, True, shared=True)
    assert torch.equal(sids.cpu(), ref_ids) and torch.equal(sids[:, :10], route(x, 10, True, True)[1])
    torch.testing.assert_close(
        sw.float().cpu(), ref_w.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6
    )
    if T > 1:
        full = triton_route(x, 10, True)
        for m in (1, 2, 5, 16, 17, 33):
            if m <= T:
                got = triton_route(x[:m].clone(), 10, True)
                assert torch.equal(got[0], full[0][:m]) and torch.equal(got[1], full[1][:m]), m


@gpu
@needs_cuda
def test_cuda_ties_and_strided() -> None:
    x = torch.zeros(3, 512, dtype=torch.bfloat16, device="cuda")
    x[1, 300] = x[1, 7] = 1.0
    w, ids = route(x, 10, True)
    assert ids[0].tolist() == list(range(10))
    assert ids[1].tolist() == [7, 300, *range(7), 8]
    assert torch.equal(ids.cpu(), route(x.cpu(), 10, True)[1])
    fused = _logits(5, 512 + 64, torch.bfloat16, seed=5, device="cuda")
    w, ids = route(fused[:, 32 : 32 + 512], 10, True)
    ref_w, ref_ids = route(fused[:, 32 : 32 + 512].cpu(), 10, True)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(w.float().cpu(), ref_w.float(), rtol=1e-2, atol=1e-6)


@gpu
@needs_cuda
def test_cuda_graph_capture() -> None:
    x = _logits(8, 512, torch.bfloat16, seed=11, device="cuda")
    eager = route(x, 10, True)
    route(x, 10, True)  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = route(x, 10, True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
    x.copy_(_logits(8, 512, torch.bfloat16, seed=12, device="cuda"))  # new inputs, same graph
    graph.replay()
    torch.cuda.synchronize()
    fresh = route(x, 10, True)
    assert torch.equal(out[0], fresh[0]) and torch.equal(out[1], fresh[1])
