"""The row-invariant grouped Triton routed experts of decode (ops/triton/moe_grouped.py) against
`_experts_by_row`, their reference, and each row against itself alone. Without a GPU the kernels run in
Triton's interpreter on the CPU (float32/float16: the interpreter's bfloat16 is broken); the bfloat16
tests at the real sizes (E=512), the strict row invariance of the MMA and the CUDA-graph replay need
CUDA (`-m gpu`)."""

import pytest
import torch
from moe_cases import moe_problem, rel_err
from triton_interp import DEV, needs_cuda, row_independent_dot, small  # noqa: F401

from nextserve.ops.moe import _experts_by_row
from nextserve.ops.triton import moe_grouped as mgd
from nextserve.ops.triton import moe_plan
from nextserve.ops.triton.moe_grouped import grouped_decode_experts

SMALL = dict(H=64, E=8, k=2, I=32)
TINY_BLOCKS = dict(block_n=16, block_k=16, block_n_down=16, block_k_down=16, block_h_combine=16)


def _check(problem, tol, **blocks) -> torch.Tensor:
    x, w, ids, gu, dn = problem
    out = grouped_decode_experts(x, w, ids, gu, dn, **blocks)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert rel_err(out, _experts_by_row(x, w, ids, gu, dn)) < tol
    return out


@small
@pytest.mark.parametrize(
    "dtype,shape,tol",
    [
        (torch.float32, (5, 64, 8, 2, 32), 1e-5),  # M, H, E, k, I
        (torch.float32, (4, 72, 6, 3, 24), 1e-5),  # no size a multiple of a block, k not a power of 2
        (torch.float32, (3, 64, 8, 8, 32), 1e-5),  # k = E: every row uses every expert
        (torch.float32, (1, 64, 8, 1, 32), 1e-5),  # one row, k = 1
        (torch.float16, (6, 64, 8, 2, 32), 3e-3),
    ],
)
def test_matches_reference(dtype, shape, tol) -> None:
    _check(moe_problem(*shape, dtype, seed=sum(shape)), tol)


@small
@pytest.mark.parametrize(
    "blocks",
    [
        TINY_BLOCKS,  # several tiles along every axis
        dict(block_n=32, block_k=32, block_n_down=32, block_k_down=32, block_h_combine=32),
        # tiles wider than the sizes (one stage: float32 tiles this wide fit a GPU's shared memory once)
        dict(block_n=64, block_k=256, block_n_down=128, block_k_down=64, stages=1, stages_down=1),
        dict(block_m=32, block_n=16, block_k=32),  # another BLOCK_M (other numerics, same contract)
    ],
)
def test_block_sizes(blocks) -> None:
    _check(moe_problem(9, 72, 8, 3, 40, torch.float32, seed=1), 1e-5, **blocks)


@small
@pytest.mark.parametrize("M,k", [(1, 2), (5, 3), (20, 2)])
@pytest.mark.usefixtures("row_independent_dot")
def test_shared_expert_as_expert_e(M: int, k: int) -> None:
    """The shared expert as id E (its own weights, added last): the kernels equal the reference, which
    equals routed experts + sigmoid-gated shared expert (sigmoid_gate's roundings); rows invariant."""
    from nextserve.ops.pointwise import sigmoid_gate, silu_mul

    x, w, ids, gu, dn = moe_problem(M, 64, 8, k, 32, torch.float32, seed=M + k)
    sg_w = torch.randn(1, 64, generator=torch.Generator().manual_seed(1)).to(x)
    sgu, sdn = gu[0] * 0.7, dn[0] * 1.3  # [2I, H], [H, I]
    gate = torch.sigmoid(x @ sg_w.t())  # [M, 1]
    w1, ids1 = torch.cat([w, gate], 1), torch.cat([ids, torch.full_like(ids[:, :1], 8)], 1)
    out = grouped_decode_experts(x, w1, ids1, gu, dn, shared=(sgu, sdn), **TINY_BLOCKS)
    ref = _experts_by_row(x, w1, ids1, gu, dn, (sgu, sdn))
    assert rel_err(out, ref) < 1e-5
    g, u = (x @ sgu.t()).chunk(2, dim=-1)
    composed = sigmoid_gate(silu_mul(g, u) @ sdn.t(), x @ sg_w.t(), _experts_by_row(x, w, ids, gu, dn))
    assert rel_err(ref, composed) < 1e-5
    for i in range(M):
        one = grouped_decode_experts(x[i : i + 1], w1[i : i + 1], ids1[i : i + 1], gu, dn, shared=(sgu, sdn),
                                     **TINY_BLOCKS)  # fmt: skip
        assert torch.equal(one[0], out[i]), i


@small
def test_some_experts_unused() -> None:
    problem = moe_problem(11, **SMALL, dtype=torch.float32, seed=2, experts_used=[1, 4, 5, 7])
    assert set(problem[2].unique().tolist()) == {1, 4, 5, 7}
    _check(problem, 1e-5)


@small
@pytest.mark.parametrize("block_m", [16, 32])
def test_one_expert_takes_all_rows(block_m) -> None:
    """Expert 3 in every row (one run of 37 pairs: three blocks at block_m=16), the other slot spread;
    then a repeated id: the reference sums both slots, in slot order."""
    x, w, ids, gu, dn = moe_problem(37, **SMALL, dtype=torch.float32, seed=3, experts_used=[0, 1, 2, 4, 6])
    ids[:, 1] = 3
    _check((x, w, ids, gu, dn), 1e-5, block_m=block_m, **TINY_BLOCKS)
    ids[:, 0] = 3
    _check((x, w, ids, gu, dn), 1e-5, block_m=block_m, **TINY_BLOCKS)


@small
def test_deterministic() -> None:
    x, w, ids, gu, dn = moe_problem(12, **SMALL, dtype=torch.float32, seed=6)
    first = grouped_decode_experts(x, w, ids, gu, dn)
    assert torch.equal(grouped_decode_experts(x.clone(), w.clone(), ids.clone(), gu, dn), first)


@small
def test_slot_order_does_not_matter() -> None:
    """The router may list a row's experts in any order: the sum is always in ascending expert id."""
    x, w, ids, gu, dn = moe_problem(6, 64, 8, 4, 32, torch.float32, seed=7)
    out = grouped_decode_experts(x, w, ids, gu, dn)
    g = torch.Generator().manual_seed(8)
    perm = torch.stack([torch.randperm(4, generator=g) for _ in range(6)]).to(ids.device)
    assert torch.equal(grouped_decode_experts(x, w.gather(1, perm), ids.gather(1, perm), gu, dn), out)


@small
def test_int32_ids_and_views() -> None:
    """int32 routing, and x a strided view (rows of a wider buffer, at a 4-byte but not 16-byte offset)."""
    x, w, ids, gu, dn = moe_problem(10, **SMALL, dtype=torch.float32, seed=9)
    out = grouped_decode_experts(x, w, ids, gu, dn)
    assert torch.equal(grouped_decode_experts(x, w, ids.to(torch.int32), gu, dn), out)
    wide = torch.zeros(10, 3 * 64 + 1, dtype=x.dtype, device=x.device)
    wide[:, 65:129] = x
    assert torch.equal(grouped_decode_experts(wide[:, 65:129], w, ids, gu, dn), out)
    assert torch.equal(grouped_decode_experts(wide[3:4, 65:129], w[3:4], ids[3:4], gu, dn), out[3:4])


@small
def test_no_rows() -> None:
    x, w, ids, gu, dn = moe_problem(1, **SMALL, dtype=torch.float32, seed=10)
    assert grouped_decode_experts(x[:0], w[:0], ids[:0], gu, dn).shape == (0, 64)


def test_depth_fits_the_k_loop_and_shared_memory() -> None:
    """The pipeline depth never passes the K loop's tile count (the FP8 decode down projection: I = 640
    in 5 tiles of 128 at 8 asked stages) nor the tile budget, and is at least 2."""
    fp8_down = 128 * (16 * 2 + 64 * 1)  # a [16 x 128] bf16 A tile and a [128 x 64] FP8 weight tile
    assert mgd._fit(8, fp8_down, k_tiles=5) == 5
    assert mgd._fit(8, fp8_down, k_tiles=20) == 8
    assert mgd._fit(4, fp8_down, k_tiles=5) == 4
    assert mgd._fit(4, 128 * 64 * 4 + 64 * 256 * 4, k_tiles=40) == 2  # float32 128-row prefill blocks
    assert mgd._fit(8, fp8_down, k_tiles=1) == 2


# ---- row invariance in the interpreter -------------------------------------------------------------
@small
@pytest.mark.usefixtures("row_independent_dot")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rows_are_invariant(dtype: torch.dtype) -> None:
    """Each row alone equals its row in batches, with neighbours that share its experts (one expert cut
    into two blocks, the row at other positions of them) and ones that do not."""
    x, w, ids, gu, dn = moe_problem(20, **SMALL, dtype=dtype, seed=11)
    ids[:14, 0] = 5  # 14 rows share expert 5 ...
    ids[:14, 1] = torch.where(ids[:14, 1] == 5, 2, ids[:14, 1])
    ids[14:] = torch.tensor([[0, 1]], device=ids.device)  # ... and 6 rows use only experts 0 and 1
    f = lambda a, b: grouped_decode_experts(x[a:b], w[a:b], ids[a:b], gu, dn, **TINY_BLOCKS)  # noqa: E731
    alone = torch.cat([f(i, i + 1) for i in range(20)])
    assert torch.equal(f(0, 20), alone)  # expert 5: 14 pairs; plus blocks of experts 0, 1 (6 + ...)
    for a, b in [(0, 2), (3, 10), (12, 17), (13, 20), (1, 19)]:  # sub-batches, rows at other positions
        assert torch.equal(f(a, b), alone[a:b]), (a, b)
    # 18 pairs of expert 5 (two blocks at BLOCK_M = 16): rows repeated, so row 13 lands in the 2nd block
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3, 13], device=ids.device)
    out = grouped_decode_experts(x[rows], w[rows], ids[rows], gu, dn, **TINY_BLOCKS)
    assert torch.equal(out, alone[rows])


# ---- CUDA: bfloat16 at the real sizes -----------------------------------------------------------
REAL = dict(H=2560, E=512, k=10, I=640)
POOL = 96  # rows of the real problem


@pytest.fixture(scope="module")
def real_weights():
    """gate_up [512, 1280, 2560] and down [512, 2560, 640] bf16 (5 GB), drawn on the device."""
    g = torch.Generator(device="cuda").manual_seed(12)
    H, E, I = REAL["H"], REAL["E"], REAL["I"]
    gate_up = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).to(torch.bfloat16)
    return gate_up, down


def _routing(M: int, seed: int, experts=None):
    """x [M, H], w [M, k], ids [M, k] (top-k of random scores, over `experts` only if given)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, REAL["H"], device="cuda", generator=g).to(torch.bfloat16)
    scores = torch.rand(M, REAL["E"], device="cuda", generator=g)
    if experts is not None:
        allowed = torch.zeros(REAL["E"], dtype=torch.bool, device="cuda")
        allowed[experts] = True
        scores = torch.where(allowed, scores, -1.0)
    top, ids = scores.topk(REAL["k"], dim=-1)
    w = (top / top.sum(-1, keepdim=True)).to(torch.bfloat16)
    return x, w, ids


@pytest.fixture(scope="module")
def real_rows():
    return _routing(POOL, seed=13)


def _exact(x, w, ids, gate_up, down) -> torch.Tensor:
    """The reference loop in float32 on the used experts only (ids renumbered in the same order)."""
    used = torch.unique(ids)
    local = torch.searchsorted(used, ids)
    return _experts_by_row(x.float(), w.float(), local, gate_up[used].float(), down[used].float())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_bf16_matches_reference(real_weights, real_rows, rows: int) -> None:
    from nextserve.ops.triton.moe_decode import routed_experts

    gu, dn = real_weights
    x, w, ids = (t[:rows] for t in real_rows)
    out = grouped_decode_experts(x, w, ids, gu, dn)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    ref = _experts_by_row(x, w, ids, gu, dn)
    exact = _exact(x, w, ids, gu, dn)
    assert rel_err(out, ref) < 1e-2
    assert rel_err(out, exact) < 1.5 * rel_err(ref, exact) + 1e-3
    assert rel_err(out, routed_experts(x, w, ids, gu, dn)) < 1e-2
    assert torch.equal(grouped_decode_experts(x, w, ids, gu, dn), out)  # deterministic


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_bf16_shared_expert_as_expert_e(real_weights, real_rows, rows: int) -> None:
    """The MoE decode path (shared expert = id E, weight sigmoid(gate)) against the reference, rows
    alone against the batch."""
    gu, dn = real_weights
    x, w, ids = (t[:rows] for t in real_rows)
    g = torch.Generator(device="cuda").manual_seed(3)
    sgu = (torch.randn(2 * REAL["I"], REAL["H"], device="cuda", generator=g) / REAL["H"] ** 0.5).bfloat16()
    sdn = (torch.randn(REAL["H"], REAL["I"], device="cuda", generator=g) / REAL["I"] ** 0.5).bfloat16()
    gate = torch.rand(rows, 1, device="cuda", generator=g).bfloat16()
    w1 = torch.cat([w, gate], 1)
    ids1 = torch.cat([ids, torch.full_like(ids[:, :1], REAL["E"])], 1)
    out = grouped_decode_experts(x, w1, ids1, gu, dn, shared=(sgu, sdn))
    assert rel_err(out, _experts_by_row(x, w1, ids1, gu, dn, (sgu, sdn))) < 1e-2
    for i in {0, rows // 2, rows - 1}:
        one = grouped_decode_experts(x[i : i + 1].clone(), w1[i : i + 1].clone(), ids1[i : i + 1].clone(), gu,
                                     dn, shared=(sgu, sdn))  # fmt: skip
        assert torch.equal(one[0], out[i]), i


@pytest.mark.gpu
@needs_cuda
def test_bf16_experts_shared_by_many_rows(real_weights, real_rows) -> None:
    """33 rows all on the same 10 experts (three blocks an expert) and the same rows on 12 experts."""
    gu, dn = real_weights
    x, w, ids = (t[:33].clone() for t in real_rows)
    ids[:] = ids[0].clone()
    for shared in (ids, _routing(33, seed=14, experts=list(range(40, 52)))[2]):
        out = grouped_decode_experts(x, w, shared, gu, dn)
        assert rel_err(out, _experts_by_row(x, w, shared, gu, dn)) < 1e-2
        assert rel_err(out, _exact(x, w, shared, gu, dn)) < 2e-2


def _batch(target: int, m: int, pos: int, kind: str, real_rows, seed: int):
    """A batch of m rows with pool row `target` at `pos`; its neighbours: "random" (other pool rows),
    "shared" (the target's experts, in another slot order, own x and w; one an exact copy of the
    target), "half" (half of the target's experts, half others), "disjoint" (none of its experts)."""
    x, w, ids = real_rows
    g = torch.Generator(device="cuda").manual_seed(seed)
    nx, nw, nids = _routing(m, seed=seed)
    mine = ids[target]
    if kind == "random":
        pick = torch.randperm(POOL, device="cuda", generator=g)
        pick = pick[pick != target][:m]
        nx, nw, nids = x[pick].clone(), w[pick].clone(), ids[pick].clone()
    elif kind == "shared":
        perm = torch.stack([torch.randperm(REAL["k"], device="cuda", generator=g) for _ in range(m)])
        nids = mine[perm]
        nx[1], nw[1], nids[1] = x[target], w[target], mine  # m >= 2
    elif kind == "half":
        nids[:, : REAL["k"] // 2] = mine[: REAL["k"] // 2]
        rest = _routing(m, seed + 1, experts=_others(mine))[2][:, : REAL["k"] - REAL["k"] // 2]
        nids[:, REAL["k"] // 2 :] = rest
    elif kind == "disjoint":
        nids = _routing(m, seed + 1, experts=_others(mine))[2]
    nx[pos], nw[pos], nids[pos] = x[target], w[target], ids[target]
    return nx, nw, nids


def _others(experts: torch.Tensor) -> list[int]:
    mine = set(experts.tolist())
    return [e for e in range(REAL["E"]) if e not in mine]


@pytest.mark.gpu
@needs_cuda
def test_bf16_rows_are_invariant(real_weights, real_rows) -> None:
    """STRICT: each row alone has the bits of its row in batches of 2..33 with any neighbours."""
    gu, dn = real_weights
    x, w, ids = real_rows
    f = lambda x, w, ids: grouped_decode_experts(x, w, ids, gu, dn)  # noqa: E731
    alone = [f(x[i : i + 1].clone(), w[i : i + 1].clone(), ids[i : i + 1].clone())[0] for i in range(POOL)]
    # views at an offset, and the whole pool at once
    assert torch.equal(f(x[5:6], w[5:6], ids[5:6])[0], alone[5])
    assert torch.equal(f(x, w, ids), torch.stack(alone))
    seed = 100
    for m in (2, 7, 16, 17, 32, 33):
        for kind in ("random", "shared", "half", "disjoint"):
            for target in (0, 41, 95):
                for pos in sorted({0, m // 2, m - 1, min(m - 1, 13)}):
                    seed += 1
                    bx, bw, bids = _batch(target, m, pos, kind, real_rows, seed)
                    out = f(bx, bw, bids)
                    assert torch.equal(out[pos], alone[target]), (m, kind, target, pos)
                    if kind == "shared":  # row 1 is an exact copy of the target
                        assert torch.equal(out[1], alone[target]), (m, kind, target, pos)
        # every row of a batch of pool rows, each against itself alone
        lo = (7 * m) % (POOL - m)
        assert torch.equal(
            f(x[lo : lo + m], w[lo : lo + m], ids[lo : lo + m]), torch.stack(alone[lo : lo + m])
        )


def _kernel_cache_keys() -> set:
    keys = set()
    for kernel in (mgd._gate_up, mgd._down, mgd._combine, moe_plan._plan):
        for cache in kernel.device_caches.values():
            keys |= {(kernel.__name__, key) for key in cache[0]}
    return keys


@pytest.mark.gpu
@needs_cuda
def test_one_binary_for_every_m(real_weights, real_rows) -> None:
    """Calls at any M, from views at any row offset, reuse the binaries compiled at M=1 (Triton
    specialises integer arguments equal to 1 or divisible by 16, and pointers by alignment)."""
    gu, dn = real_weights
    x, w, ids = real_rows
    grouped_decode_experts(x[:1], w[:1], ids[:1], gu, dn)
    try:
        before = _kernel_cache_keys()
    except (AttributeError, TypeError, IndexError):
        pytest.skip("this Triton's kernel cache layout is not known")
    for m in (1, 2, 3, 7, 16, 17, 32, 33, 64):
        for lo in (0, 1, 3):
            grouped_decode_experts(x[lo : lo + m], w[lo : lo + m], ids[lo : lo + m], gu, dn)
            grouped_decode_experts(x[lo : lo + m], w[lo : lo + m], ids[lo : lo + m].int(), gu, dn)
    grouped_decode_experts(x[:1], w[:1], ids[:1].int(), gu, dn)
    after = _kernel_cache_keys()
    # int32 ids add one binary of _plan and _combine (other pointer type), nothing else
    new = after - before
    assert {name for name, _ in new} <= {"_plan", "_combine"} and len(new) <= 2, new


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_cuda_graph_capture(real_weights, rows: int) -> None:
    """No host reads: the call captures in a CUDA graph, and a replay on new rows and routing (skewed:
    every row on the same experts) equals an eager call."""
    gu, dn = real_weights
    x, w, ids = _routing(rows, seed=20 + rows)
    grouped_decode_experts(x, w, ids, gu, dn)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grouped_decode_experts(x, w, ids, gu, dn)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_decode_experts(x, w, ids, gu, dn)
    for seed, skew in ((30, False), (31, True)):
        nx, nw, nids = _routing(rows, seed=seed + rows)
        if skew:
            nids[:] = nids[0].clone()
        x.copy_(nx)
        w.copy_(nw)
        ids.copy_(nids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, grouped_decode_experts(x, w, ids, gu, dn)), (rows, skew)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_cuda_other_dtypes(dtype, tol) -> None:
    _check(moe_problem(20, 512, 64, 6, 256, dtype, seed=21, device="cuda"), tol)
