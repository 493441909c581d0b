"""The hyper-connection mix in one launch (ops/triton/hc_mix.py): against the float64 reference chain
(ops/hyper.hc_mix on the CPU), its rows against themselves, the one-launch kernel against the three-launch
split bit for bit, and inside a CUDA graph. Without a GPU the split runs in Triton's interpreter
(float32/float16); the real widths in bfloat16 are the `gpu` tests."""

from types import SimpleNamespace

import pytest
import torch
from triton_interp import DEV, needs_cuda, row_independent_dot, small  # noqa: F401

from nextserve.model.hyper import GatedResidual
from nextserve.ops import hyper
from nextserve.ops.triton import hc_mix as hc
from nextserve.ops.triton.common import pdl_mode

gpu = pytest.mark.gpu
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _problem(M: int, n: int, H: int, rank: int, inject: bool, dtype: torch.dtype, seed: int = 0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    R = rank + (n if inject else 0)
    x = torch.randn(M, n * H, generator=g) * 2
    x[:, :H] *= 5  # streams of different scales: each gets its own rstd
    nw = torch.randn(n * H, generator=g) * 0.2
    wd = torch.randn(R, n * H, generator=g) / (n * H) ** 0.5
    wu = torch.randn(n * H, rank, generator=g) / rank**0.5
    return [t.to(dtype).to(device) for t in (x, nw, wd, wu)]


def _reference(x, nw, wd, wu, n, rank):
    u, v = hyper.hc_mix(*(t.double().cpu() for t in (x, nw, wd, wu)), n, rank, 1e-6)
    return u, v


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double().cpu() - ref).norm() / ref.norm()).item()


# (n, H, rank, inject): the test model's widths, a partial chunk, three streams (padded to four), and
# chunks that split a stream (TILE_BYTES lowered below)
CASES = [(4, 48, 8, True), (4, 64, 8, False), (3, 100, 20, True), (2, 200, 24, True)]


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch):
    """Chunks of 32 columns, so a stream is cut into several (the real widths' plan) at test sizes."""
    monkeypatch.setattr(hc, "TILE_BYTES", 32 * 16 * 4)
    hc._plan.cache_clear()
    yield
    hc._plan.cache_clear()


@small
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,H,rank,inject", CASES)
def test_matches_reference(dtype, n, H, rank, inject) -> None:
    x, nw, wd, wu = _problem(11, n, H, rank, inject, dtype, seed=n * H)
    u, v = hc.triton_hc_mix(x, nw, wd, wu, n, rank, 1e-6, one_launch=False)
    ur, vr = _reference(x, nw, wd, wu, n, rank)
    assert u.dtype == dtype and u.shape == (11, H)
    assert _rel(u, ur) < TOL[dtype]
    assert (v is None) == (not inject)
    if inject:
        assert v.shape == (11, n) and _rel(v, vr) < TOL[dtype]


@small
@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunks_within_a_stream(dtype) -> None:
    n, H, rank = 4, 100, 8  # 32-column chunks: 4 per stream, the last partial
    assert hc._plan(n, H, rank + n, rank, torch.tensor([], dtype=dtype).element_size()).cps > 1
    x, nw, wd, wu = _problem(5, n, H, rank, True, dtype, seed=3)
    u, v = hc.triton_hc_mix(x, nw, wd, wu, n, rank, 1e-6, one_launch=False)
    ur, vr = _reference(x, nw, wd, wu, n, rank)
    assert _rel(u, ur) < TOL[dtype] and _rel(v, vr) < TOL[dtype]


@small
@pytest.mark.usefixtures("row_independent_dot")
@pytest.mark.parametrize("n,H,rank,inject", CASES[:3])
def test_rows_are_invariant(n, H, rank, inject) -> None:
    x, nw, wd, wu = _problem(20, n, H, rank, inject, torch.float32, seed=1)

    def run(t):
        return hc.triton_hc_mix(t, nw, wd, wu, n, rank, 1e-6, one_launch=False)

    u, v = run(x)
    for i in (0, 7, 19):
        ui, vi = run(x[i : i + 1].clone())
        assert torch.equal(ui[0], u[i]) and (v is None or torch.equal(vi[0], v[i])), i
    for a, b in [(0, 17), (3, 20)]:  # across the 16-row block boundary
        ua, va = run(x[a:b].clone())
        assert torch.equal(ua, u[a:b]) and (v is None or torch.equal(va, v[a:b])), (a, b)
    u0, v0 = run(x[:0])
    assert u0.shape == (0, H) and (v0 is None or v0.shape == (0, n))


def test_plan_is_a_function_of_the_shapes() -> None:
    """The real widths: 120 tiles (6 blocks of 64 down|inject rows x 20 chunks of 512), a mix slice per
    tile, the final mixer (no inject rows) 100, 128 mix slices; chunks never straddle streams."""
    p = hc._plan(4, 2560, 324, 320, 2)
    assert (p.bn, p.kc, p.cps, p.tiles, p.units) == (64, 512, 5, 120, 128)
    assert p.vc * p.units >= 2560 > p.vc * (p.units - 1) and p.bc >= p.vc
    assert hc._plan(4, 2560, 320, 320, 2).tiles == 100
    assert hc._plan(4, 2560, 324, 320, 4).kc == 256  # fp32: the same tile bytes


def test_cpu_module_takes_the_reference_chain() -> None:
    """On the CPU the op is the chain the module ran before (bits), fused or not."""
    cfg = SimpleNamespace(hc_count=4, hidden_size=48, rms_norm_eps=1e-6, hc_hidden=192, hc_lowrank=8)
    m = GatedResidual(cfg)
    g = torch.Generator().manual_seed(0)
    for p in m.parameters():
        p.data = (torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5).bfloat16()
    x = torch.randn(5, 192, generator=g).bfloat16()
    before = m.mix(x, True)
    m.fuse()
    after = m.mix(x, True)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


# ---- CUDA: the real widths in bfloat16 ---------------------------------------------------------------
REAL = (4, 2560, 320)


@gpu
@needs_cuda
@pytest.mark.parametrize("inject", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_one_launch(inject: bool, dtype: torch.dtype) -> None:
    """The one-launch kernel: the split's bits, the reference within rounding, rows invariant (alone and in
    batches of 2..40), PDL on = off, the counters left zero, equal on every repeat."""
    n, H, rank = REAL
    x, nw, wd, wu = _problem(40, n, H, rank, inject, dtype, seed=5, device="cuda")

    def run(t, one=True):
        return hc.triton_hc_mix(t, nw, wd, wu, n, rank, 1e-6, one_launch=one)

    u, v = run(x)
    us, vs = run(x, one=False)
    assert torch.equal(u, us) and (v is None or torch.equal(v, vs))
    ur, vr = _reference(x, nw, wd, wu, n, rank)
    assert _rel(u, ur) < TOL[dtype] and (v is None or _rel(v, vr) < TOL[dtype])
    for i in (0, 13, 39):
        ui, vi = run(x[i : i + 1].clone())
        assert torch.equal(ui[0], u[i]) and (v is None or torch.equal(vi[0], v[i])), i
    for a, b in [(0, 2), (3, 20), (5, 37)]:
        ua, va = run(x[a:b].clone())
        assert torch.equal(ua, u[a:b]) and (v is None or torch.equal(va, v[a:b])), (a, b)
    with pdl_mode(True):
        up, vp = run(x)
    assert torch.equal(up, u) and (v is None or torch.equal(vp, v))
    for _ in range(20):
        ur2, _ = run(x[:8])
        assert torch.equal(ur2, u[:8])
    torch.cuda.synchronize()
    assert int(hc._COUNTERS[x.device].abs().sum()) == 0


@gpu
@needs_cuda
def test_cuda_graph_and_module() -> None:
    """A fused GatedResidual's mix in a CUDA graph (with PDL, 17 mixes back to back as in a decode step)
    equals its eager calls, and the prefill path (not row-invariant) stays within rounding of it."""
    n, H, rank = REAL
    cfg = SimpleNamespace(hc_count=n, hidden_size=H, rms_norm_eps=1e-6, hc_hidden=n * H, hc_lowrank=rank)
    mods = []
    g = torch.Generator().manual_seed(2)
    for i in range(3):
        m = GatedResidual(cfg, inject=i < 2)
        for p in m.parameters():
            p.data = (torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5).bfloat16().cuda()
        m.fuse()
        mods.append(m)
    x = torch.randn(8, n * H, generator=g).bfloat16().cuda()

    def chain(t):
        outs = []
        for _ in range(6):
            for m in mods:
                u, v = m.mix(t, True)
                outs.append(u)
                t = t + u.repeat(1, n) * 0.01
        return outs

    eager = chain(x)
    with pdl_mode(True):
        chain(x)  # compile the PDL variant outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = chain(x)
        for _ in range(5):
            graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, eager, strict=False))
    u_pre, _ = mods[0].mix(x, False)  # the unfused chain of prefill
    assert _rel(eager[0], u_pre.double().cpu()) < 2e-2
