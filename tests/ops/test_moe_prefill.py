"""The grouped Triton routed experts of prefill (`grouped_experts` in ops/triton/moe_grouped.py: the
kernels of decode with prefill's blocks) against `_experts_by_expert`, their reference (the per-expert
loop of experts(row_invariant=False)). Without a GPU the kernels run in Triton's interpreter on the CPU
(float32/float16: the interpreter's bfloat16 is broken); the bfloat16 tests at the real widths need
CUDA."""

import pytest
import torch
from moe_cases import moe_problem, rel_err
from triton_interp import needs_cuda, row_independent_dot, small  # noqa: F401

from nextserve.ops.fp8 import Fp8Weight, quantize
from nextserve.ops.moe import _experts_by_expert, default_block_m, experts, experts_of_chunks
from nextserve.ops.triton.moe_grouped import grouped_experts

SMALL = dict(H=64, E=8, k=2, I=32)


def _check(problem, tol, **blocks) -> torch.Tensor:
    x, w, ids, gu, dn = problem
    out = grouped_experts(x, w, ids, gu, dn, **blocks)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert rel_err(out, _experts_by_expert(x, w, ids, gu, dn)) < tol
    return out


@small
@pytest.mark.parametrize(
    "dtype,shape,tol",
    [
        (torch.float32, (40, 64, 8, 2, 32), 1e-5),  # T, H, E, k, I
        (torch.float32, (23, 72, 6, 3, 24), 1e-5),  # no size a multiple of a block, k not a power of 2
        (torch.float32, (9, 64, 8, 8, 32), 1e-5),  # k = E: every token uses every expert
        (torch.float16, (30, 64, 8, 2, 32), 3e-3),
    ],
)
def test_matches_reference(dtype, shape, tol) -> None:
    _check(moe_problem(*shape, dtype, seed=sum(shape)), tol)


@small
@pytest.mark.parametrize(
    "blocks",
    [
        dict(block_m=16, block_n=16, block_k=16, block_n_down=16, block_k_down=16, block_h_combine=16),
        dict(block_m=32, block_n=32, block_k=32, block_n_down=32, block_k_down=32),
        dict(block_m=64, block_n=64, block_k=64, block_n_down=64, block_k_down=64),
        dict(block_m=128, block_n=32, block_k=32, block_n_down=32, block_k_down=32),  # 8 warps
        dict(block_m=16, block_n=64, block_k=128, block_n_down=128, block_k_down=64),  # blocks > sizes
    ],
)
def test_block_sizes(blocks) -> None:
    """Several tiles along every axis, and tiles wider than the sizes (masked)."""
    _check(moe_problem(37, **SMALL, dtype=torch.float32, seed=1), 1e-5, **blocks)


@small
def test_some_experts_unused() -> None:
    problem = moe_problem(33, **SMALL, dtype=torch.float32, seed=2, experts_used=[1, 4, 5, 7])
    assert set(problem[2].unique().tolist()) == {1, 4, 5, 7}
    _check(problem, 1e-5)
    _check(problem, 1e-5, block_m=16)


@small
@pytest.mark.parametrize("block_m", [16, 64])
def test_one_expert_takes_all_tokens(block_m) -> None:
    """Expert 3 in every token (one run of 40 pairs: three blocks at block_m=16), the other slot spread."""
    x, w, ids, gu, dn = moe_problem(40, **SMALL, dtype=torch.float32, seed=3, experts_used=[0, 1, 2, 4, 6])
    ids[:, 1] = 3
    _check((x, w, ids, gu, dn), 1e-5, block_m=block_m)
    ids[:, 0] = 3  # a repeated id: the reference sums both slots, in slot order
    _check((x, w, ids, gu, dn), 1e-5, block_m=block_m)


@small
def test_one_token() -> None:
    _check(moe_problem(1, **SMALL, dtype=torch.float32, seed=4), 1e-5)
    _check(moe_problem(1, 64, 8, 1, 32, torch.float32, seed=5), 1e-5)  # k = 1


@small
def test_deterministic() -> None:
    x, w, ids, gu, dn = moe_problem(40, **SMALL, dtype=torch.float32, seed=6)
    first = grouped_experts(x, w, ids, gu, dn)
    assert torch.equal(grouped_experts(x, w, ids, gu, dn), first)
    assert torch.equal(grouped_experts(x.clone(), w.clone(), ids.clone(), gu, dn), first)


@small
def test_slot_order_does_not_matter() -> None:
    """The router may list a token's experts in any order: the sum is always in ascending expert id."""
    x, w, ids, gu, dn = moe_problem(12, 64, 8, 4, 32, torch.float32, seed=7)
    out = grouped_experts(x, w, ids, gu, dn)
    g = torch.Generator().manual_seed(8)
    perm = torch.stack([torch.randperm(4, generator=g) for _ in range(12)]).to(ids.device)
    assert torch.equal(grouped_experts(x, w.gather(1, perm), ids.gather(1, perm), gu, dn), out)


@small
def test_int32_ids_and_views() -> None:
    """int32 routing, and x a strided view (rows of a wider buffer)."""
    x, w, ids, gu, dn = moe_problem(10, **SMALL, dtype=torch.float32, seed=9)
    out = grouped_experts(x, w, ids, gu, dn)
    assert torch.equal(grouped_experts(x, w, ids.to(torch.int32), gu, dn), out)
    wide = torch.zeros(10, 3 * 64, dtype=x.dtype, device=x.device)
    wide[:, 64:128] = x
    assert torch.equal(grouped_experts(wide[:, 64:128], w, ids, gu, dn), out)


@small
@pytest.mark.parametrize("block_m", [16, 64])
def test_launch_order_does_not_change_bits(block_m: int) -> None:
    """Grids (N tiles, blocks) and (blocks, N tiles) run the same programs: equal bits."""
    x, w, ids, gu, dn = moe_problem(45, 72, 6, 3, 40, torch.float32, seed=11)
    blocks = dict(block_m=block_m, block_n=16, block_n_down=32)
    out = _check((x, w, ids, gu, dn), 1e-5, n_fast=True, **blocks)
    assert torch.equal(grouped_experts(x, w, ids, gu, dn, n_fast=False, **blocks), out)


@small
def test_more_blocks_than_a_grid_axis_takes_blocks_first(monkeypatch) -> None:
    """Past _GRID_Y_MAX blocks (65,535: a CUDA grid's second axis) prefill launches blocks first: the
    same bits."""
    import nextserve.ops.triton.moe_grouped as mg

    x, w, ids, gu, dn = moe_problem(45, 72, 6, 3, 40, torch.float32, seed=12)
    out = grouped_experts(x, w, ids, gu, dn, block_m=16)
    monkeypatch.setattr(mg, "_GRID_Y_MAX", 2)
    assert torch.equal(_check((x, w, ids, gu, dn), 1e-5, block_m=16), out)


@small
def test_no_tokens() -> None:
    x, w, ids, gu, dn = moe_problem(1, **SMALL, dtype=torch.float32, seed=10)
    out = grouped_experts(x[:0], w[:0], ids[:0], gu, dn)
    assert out.shape == (0, 64)


def test_default_block_m() -> None:
    assert default_block_m(64 * 10, 512) == 16
    assert default_block_m(256 * 10, 512) == 16
    assert default_block_m(1024 * 10, 512) == 32
    assert default_block_m(40 * 2, 8) == 32
    assert default_block_m(4096 * 10, 512) == 128
    assert default_block_m(2048 * 10, 512) == 64
    assert default_block_m(3276 * 10, 512) == 64  # 63.98 pairs an expert
    assert default_block_m(3277 * 10, 512) == 128
    assert default_block_m(8192 * 10, 512) == 128


@small
@pytest.mark.usefixtures("row_independent_dot")
@pytest.mark.parametrize("block_m", [16, 32])
def test_chunks_together_equal_alone(block_m: int) -> None:
    """Three chunks' rows in one call with the blocks of one chunk: each chunk's rows get the bits of its
    own call (the kernels' structure: where a pair lands in a block moves its result, not its bits)."""
    x, w, ids, gu, dn = moe_problem(60, **SMALL, dtype=torch.float32, seed=21)
    together = grouped_experts(x, w, ids, gu, dn, block_m=block_m)
    for s in range(0, 60, 20):
        alone = grouped_experts(x[s : s + 20], w[s : s + 20], ids[s : s + 20], gu, dn, block_m=block_m)
        assert torch.equal(together[s : s + 20], alone)


def test_experts_of_chunks_on_the_cpu_is_one_call_a_chunk() -> None:
    x, w, ids, gu, dn = moe_problem(30, **SMALL, dtype=torch.float32, seed=22, device="cpu")
    parts = experts_of_chunks(list(x.split(10)), list(w.split(10)), list(ids.split(10)), gu, dn)
    for part, s in zip(parts, (0, 10, 20), strict=True):
        assert torch.equal(part, experts(x[s : s + 10], w[s : s + 10], ids[s : s + 10], gu, dn, False))
    with pytest.raises(AssertionError):
        experts_of_chunks([x[:10], x[10:25]], [w[:10], w[10:25]], [ids[:10], ids[10:25]], gu, dn)


def test_cpu_path_is_the_reference() -> None:
    """On CPU tensors experts(row_invariant=False) is the per-expert loop, whatever the dtype."""
    x, w, ids, gu, dn = moe_problem(20, **SMALL, dtype=torch.float32, seed=11, device="cpu")
    assert torch.equal(experts(x, w, ids, gu, dn, row_invariant=False), _experts_by_expert(x, w, ids, gu, dn))


# ---- CUDA: bfloat16 at the real widths -----------------------------------------------------------
REAL = dict(H=2560, E=512, k=10, I=640)


@pytest.fixture(scope="module")
def real_problem():
    return moe_problem(
        1024, REAL["H"], REAL["E"], REAL["k"], REAL["I"], torch.bfloat16, seed=12, device="cuda"
    )


@pytest.fixture(scope="module")
def real_weights_fp32(real_problem):
    return real_problem[3].float(), real_problem[4].float()


def _check_real(x, w, ids, gu, dn, weights_fp32, **blocks) -> torch.Tensor:
    out = grouped_experts(x, w, ids, gu, dn, **blocks)
    ref = _experts_by_expert(x, w, ids, gu, dn)
    exact = _experts_by_expert(x.float(), w.float(), ids, *weights_fp32)
    assert rel_err(out, ref) < 1e-2
    assert rel_err(out, exact) < 1.5 * rel_err(ref, exact) + 1e-3
    return out


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 64, 256, 1024])
def test_bf16_matches_reference(real_problem, real_weights_fp32, tokens: int) -> None:
    x, w, ids, gu, dn = (t[:tokens] if t.dim() == 2 else t for t in real_problem)
    out = _check_real(x, w, ids, gu, dn, real_weights_fp32)
    # the CUDA grouped path of experts() is this kernel
    assert torch.equal(experts(x, w, ids, gu, dn, row_invariant=False), out)
    assert torch.equal(grouped_experts(x, w, ids, gu, dn), out)  # deterministic


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_bf16_block_m(real_problem, real_weights_fp32, block_m: int) -> None:
    _check_real(*real_problem, real_weights_fp32, block_m=block_m)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_launch_order_does_not_change_bits(real_problem, fp8: bool) -> None:
    x, w, ids, gu, dn = real_problem
    if fp8:
        gu, dn = Fp8Weight(*quantize(gu)), Fp8Weight(*quantize(dn))
    for block_m in (32, 128):
        fast = grouped_experts(x, w, ids, gu, dn, block_m=block_m, n_fast=True)
        assert torch.equal(grouped_experts(x, w, ids, gu, dn, block_m=block_m, n_fast=False), fast)


@pytest.mark.gpu
@needs_cuda
def test_bf16_skewed_routing(real_problem, real_weights_fp32) -> None:
    """Every token on experts 0..9 (runs of 1024 pairs: 16+ blocks an expert), others unused."""
    x, w, ids, gu, dn = real_problem
    ids = torch.arange(10, device="cuda").flip(0).expand(1024, 10).contiguous()
    _check_real(x, w, ids, gu, dn, real_weights_fp32)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("block_m", [None, 128])
def test_cuda_other_dtypes(dtype, tol, block_m) -> None:
    """block_m 128 (a 4,096-token chunk's): float32 tiles at 4 stages asked for 288 KB of shared memory
    and did not launch (moe_grouped._fit)."""
    problem = moe_problem(200, 512, 64, 6, 256, dtype, seed=13, device="cuda")
    _check(problem, tol, block_m=block_m)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_capture(real_problem) -> None:
    """No host reads: the call captures in a CUDA graph, and a replay on new routing is exact."""
    x, w, ids, gu, dn = (t[:256].clone() if t.dim() == 2 else t for t in real_problem)
    grouped_experts(x, w, ids, gu, dn)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grouped_experts(x, w, ids, gu, dn)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_experts(x, w, ids, gu, dn)
    ids.copy_(ids.flip(0))
    w.copy_(w.flip(0))
    ids[:, 0] = 7  # a skewed expert: more blocks than before, within the same bound
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, grouped_experts(x, w, ids, gu, dn))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "n,chunks,fp8", [(300, 3, False), (1000, 2, False), (4096, 2, False), (4096, 2, True)]
)
def test_chunks_together_equal_alone_on_cuda(real_problem, n: int, chunks: int, fp8: bool) -> None:
    """experts_of_chunks at the real widths: one grouped call for every chunk's rows, each chunk's rows
    with the bits experts() gives it alone (BLOCK_M 16, 32, 64; FP8 128 with 8 warps), torch.equal."""
    _, _, _, gu, dn = real_problem
    if fp8:
        gu, dn = Fp8Weight(*quantize(gu)), Fp8Weight(*quantize(dn))
    x, w, ids, _, _ = moe_problem(
        n * chunks, REAL["H"], 8, REAL["k"], 8, torch.bfloat16, seed=n, device="cuda"
    )
    ids = torch.randint(0, REAL["E"], (n * chunks, REAL["k"]), device="cuda", generator=None)
    xs, ws, idss = (list(t.split(n)) for t in (x, w, ids))
    together = experts_of_chunks(xs, ws, idss, gu, dn)
    for xi, wi, ii, out in zip(xs, ws, idss, together, strict=True):
        assert torch.equal(out, experts(xi, wi, ii, gu, dn, row_invariant=False))
