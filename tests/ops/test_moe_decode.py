"""The row-invariant Triton routed experts (ops/triton/moe_decode.py) against `_experts_by_row`, its
reference, and against itself at other M. Without a GPU the kernels run in Triton's interpreter on the
CPU (float32/float16: the interpreter's bfloat16 is broken); the bfloat16 tests at real widths need CUDA."""

import pytest
import torch
from moe_cases import moe_problem, rel_err
from triton_interp import needs_cuda, small

from nextserve.ops.moe import _experts_by_row, experts
from nextserve.ops.triton.moe_decode import routed_experts


@small
@pytest.mark.parametrize(
    "dtype,shape,tol",
    [
        (torch.float32, (5, 64, 8, 2, 32), 1e-5),  # M, H, E, k, I
        (torch.float32, (4, 72, 6, 3, 24), 1e-5),  # no size a multiple of a block, k not a power of 2
        (torch.float16, (3, 64, 8, 2, 32), 3e-3),
    ],
)
def test_matches_reference(dtype, shape, tol) -> None:
    x, w, ids, gu, dn = moe_problem(*shape, dtype, seed=sum(shape))
    out = routed_experts(x, w, ids, gu, dn)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, _experts_by_row(x, w, ids, gu, dn)) < tol


@small
def test_rows_are_invariant() -> None:
    x, w, ids, gu, dn = moe_problem(7, 64, 8, 2, 32, torch.float32, seed=1)
    full = routed_experts(x, w, ids, gu, dn)
    for i in range(7):  # each row alone, from a view
        assert torch.equal(routed_experts(x[i : i + 1], w[i : i + 1], ids[i : i + 1], gu, dn)[0], full[i]), i
    for a, b in [(0, 3), (3, 7), (1, 6)]:  # sub-batches
        part = routed_experts(x[a:b].clone(), w[a:b].clone(), ids[a:b].clone(), gu, dn)
        assert torch.equal(part, full[a:b]), (a, b)


@small
def test_slot_order_does_not_matter() -> None:
    """The router may list a row's experts in any order: the sum is always in ascending expert id."""
    x, w, ids, gu, dn = moe_problem(4, 64, 8, 4, 32, torch.float32, seed=2)
    out = routed_experts(x, w, ids, gu, dn)
    g = torch.Generator().manual_seed(3)
    perm = torch.stack([torch.randperm(4, generator=g) for _ in range(4)]).to(ids.device)
    shuffled = routed_experts(x, w.gather(1, perm), ids.gather(1, perm), gu, dn)
    assert torch.equal(shuffled, out)
    srt, order = ids.sort(dim=1)
    assert torch.equal(routed_experts(x, w.gather(1, order), srt, gu, dn), out)


@small
def test_experts_shared_across_rows() -> None:
    """Rows routed to the same experts (and equal rows) get their own programs and equal bits."""
    x, w, ids, gu, dn = moe_problem(6, 64, 8, 3, 32, torch.float32, seed=4)
    ids[:] = ids[0]
    ids[3] = ids[0].flip(0)
    x[4], w[4] = x[1], w[1]
    w[3] = w[0].flip(0)
    x[3] = x[0]
    out = routed_experts(x, w, ids, gu, dn)
    assert rel_err(out, _experts_by_row(x, w, ids, gu, dn)) < 1e-5
    assert torch.equal(out[4], out[1]) and torch.equal(out[3], out[0])


@small
def test_every_expert_routed() -> None:
    """k = E: every row uses every expert (k a power of 2 here, no padded slots)."""
    x, w, ids, gu, dn = moe_problem(3, 64, 8, 8, 32, torch.float32, seed=5)
    out = routed_experts(x, w, ids, gu, dn)
    assert rel_err(out, _experts_by_row(x, w, ids, gu, dn)) < 1e-5
    assert torch.equal(routed_experts(x[2:], w[2:], ids[2:], gu, dn), out[2:])


@small
def test_no_rows() -> None:
    x, w, ids, gu, dn = moe_problem(1, 64, 8, 2, 32, torch.float32, seed=6)
    assert routed_experts(x[:0], w[:0], ids[:0], gu, dn).shape == (0, 64)


# ---- CUDA: bfloat16 at real widths ---------------------------------------------------------------
REAL = dict(H=2560, E=64, k=10, I=640)


@pytest.fixture(scope="module")
def real_problem():
    return moe_problem(40, REAL["H"], REAL["E"], REAL["k"], REAL["I"], torch.bfloat16, seed=7, device="cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 8, 40])
def test_bf16_matches_reference(real_problem, rows: int) -> None:
    x, w, ids, gu, dn = (t[:rows] if t.dim() == 2 else t for t in real_problem)
    out = routed_experts(x, w, ids, gu, dn)
    ref = _experts_by_row(x, w, ids, gu, dn)
    exact = _experts_by_row(x.double(), w.double(), ids, gu.double(), dn.double())
    assert rel_err(out, ref) < 1e-2
    assert rel_err(out, exact) < 1.5 * rel_err(ref, exact) + 1e-3
    # the CUDA row-invariant path of experts() is the grouped decode kernel
    from nextserve.ops.triton.moe_grouped import grouped_decode_experts

    assert torch.equal(
        experts(x, w, ids, gu, dn, row_invariant=True), grouped_decode_experts(x, w, ids, gu, dn)
    )


@pytest.mark.gpu
@needs_cuda
def test_bf16_rows_are_invariant(real_problem) -> None:
    x, w, ids, gu, dn = real_problem
    full = routed_experts(x, w, ids, gu, dn)
    for m in (1, 2, 7, 16, 33):
        part = routed_experts(x[:m].clone(), w[:m].clone(), ids[:m].clone(), gu, dn)
        assert torch.equal(part, full[:m]), m
        tail = routed_experts(x[-m:], w[-m:], ids[-m:], gu, dn)  # views at an offset
        assert torch.equal(tail, full[-m:]), m
    for i in (0, 5, 39):
        assert torch.equal(routed_experts(x[i : i + 1], w[i : i + 1], ids[i : i + 1], gu, dn)[0], full[i])


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_capture(real_problem) -> None:
    """No host reads: the call captures in a CUDA graph, and a replay on new routing is exact."""
    x, w, ids, gu, dn = (t[:8].clone() if t.dim() == 2 else t for t in real_problem)
    routed_experts(x, w, ids, gu, dn)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_experts(x, w, ids, gu, dn)
    ids.copy_(ids.flip(0))
    w.copy_(w.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, routed_experts(x, w, ids, gu, dn))
