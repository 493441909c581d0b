"""The row-invariant Triton small-M GEMM (ops/triton/gemv.py) on small shapes, with one split and with
several: against float64 F.linear, and each row against itself at other M. Without a GPU the kernels
run in Triton's interpreter on the CPU (float32/float16: the interpreter's bfloat16 is broken); the
bfloat16 tests at real widths are tests/gpu/test_small_m_gemm.py."""

import pytest
import torch
import triton
from triton_interp import DEV, row_independent_dot, small  # noqa: F401

from nextserve.ops.triton.gemv import small_m_linear
from nextserve.ops.triton.gemv_config import MIN_SPLIT_K_TILES, TARGET_PROGRAMS, gemv_config

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}

# (N, K, splits asked for): None is the automatic configuration
CASES = [
    (4, 2048, None),  # N below one tile, K split into one tile per split (8 or 16 splits)
    (33, 64, None),  # one split, one partial K tile, a partial N tile
    (40, 300, 1),  # one split, three K tiles (the last partial)
    (40, 300, 2),  # two uneven splits: the last one shorter, its tile partial
    (24, 1100, 3),  # three splits of several tiles each
]


def _problem(M: int, N: int, K: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(device=DEV, dtype=dtype)
    x = torch.randn(M, K, generator=g).to(device=DEV, dtype=dtype)
    return x, w


def test_config_is_a_function_of_the_weight_and_fills_the_device() -> None:
    """The decode shapes at real size: enough programs (or a split per K tile, or too short a K loop to
    split), no empty split; `gemv_config` takes no M, so no choice can depend on it."""
    shapes = [(248320, 2560), (10240, 2560), (6144, 2560), (48, 2560), (2560, 6144), (12288, 2560),
              (512, 2560), (640, 2560), (2560, 2560), (320, 10240), (10240, 320), (4, 10240),
              (2560, 640), (1, 2560)]  # fmt: skip
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for N, K in shapes:
            c = gemv_config(N, K, dtype)
            k_tiles = triton.cdiv(K, c.block_k)
            assert c.splits * c.split_tiles >= k_tiles > (c.splits - 1) * c.split_tiles, (N, K, c)
            programs = triton.cdiv(N, c.block_n) * c.splits
            assert programs >= TARGET_PROGRAMS or c.splits == k_tiles or k_tiles < MIN_SPLIT_K_TILES
            assert c.block_n * c.block_k * dtype.itemsize <= 8192
    assert (
        gemv_config(4, 10240, torch.bfloat16).splits > 1
        and gemv_config(248320, 2560, torch.bfloat16).splits == 1
    )


@small
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N,K,splits", CASES)
def test_matches_reference(dtype: torch.dtype, N: int, K: int, splits: int | None) -> None:
    x, w = _problem(20, N, K, dtype, seed=N + K)
    y = small_m_linear(x, w, splits=splits)
    assert y.dtype == dtype and y.shape == (20, N)
    ref = torch.nn.functional.linear(x.double(), w.double())
    assert ((y.double() - ref).norm() / ref.norm()).item() < TOL[dtype]


def test_cases_cover_one_and_several_splits() -> None:
    assert gemv_config(4, 2048, torch.float16).splits > 1 and gemv_config(4, 2048, torch.float32).splits > 1
    assert gemv_config(33, 64, torch.float16).splits == gemv_config(33, 64, torch.float32).splits == 1


@small
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N,K,splits", [(4, 2048, None), (40, 300, 1), (40, 300, 2)])
@pytest.mark.usefixtures("row_independent_dot")
def test_rows_are_invariant(dtype: torch.dtype, N: int, K: int, splits: int | None) -> None:
    x, w = _problem(20, N, K, dtype, seed=7)
    full = small_m_linear(x, w, splits=splits)
    for i in (5, 16, 19):  # a row alone, from a view (at an odd row: unaligned for K = 300 fp16)
        assert torch.equal(small_m_linear(x[i : i + 1], w, splits=splits)[0], full[i]), i
    for a, b in [(0, 17), (3, 20)]:  # sub-batches, across the 16-row block boundary
        assert torch.equal(small_m_linear(x[a:b].clone(), w, splits=splits), full[a:b]), (a, b)
    assert small_m_linear(x[:0], w, splits=splits).shape == (0, N)


@small
@pytest.mark.parametrize("N,K,splits", [(4, 2048, None), (40, 300, 1), (40, 300, 2), (40, 1100, 1)])
@pytest.mark.usefixtures("row_independent_dot")
def test_weight_preload_gives_the_loop_bits(N: int, K: int, splits: int | None) -> None:
    """A split of at most PRELOAD_TILES tiles loads them before the PDL wait (1, 3 and 2 tiles here; 5 tiles
    preload none): the same bits as the plain K loop."""
    from nextserve.ops.triton.gemv_config import preload_tiles

    x, w = _problem(20, N, K, torch.float16, seed=13)
    loop = small_m_linear(x, w, splits=splits, preload=False)
    assert torch.equal(small_m_linear(x, w, splits=splits), loop)
    assert preload_tiles(1) == 1 and preload_tiles(4) == 4 and preload_tiles(5) == 0


@small
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N,K,splits", [(4, 2048, None), (40, 300, 2), (24, 1100, 3)])
def test_one_launch_reduction_gives_the_two_launch_bits(dtype: torch.dtype, N: int, K: int, splits) -> None:
    """The split-K partials added by the tile's last program (one launch) give the bits of the separate
    reduction kernel, and leave every tile counter at zero for the next call."""
    from nextserve.ops.triton.common import tile_counters

    x, w = _problem(20, N, K, dtype, seed=11)
    one = small_m_linear(x, w, splits=splits)
    two = small_m_linear(x, w, splits=splits, one_launch=False)
    assert torch.equal(one, two)
    assert torch.equal(small_m_linear(x, w, splits=splits), one)  # the counters were reset
    assert int(tile_counters(x.device).abs().sum()) == 0


@small
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "N,K,splits,one_launch", [(12, 2048, None, True), (12, 2048, None, False), (40, 300, 1, True)]
)
def test_silu_epilogue_gives_the_separate_activation_bits(
    dtype, N: int, K: int, splits, one_launch: bool
) -> None:
    """silu(y / n) on the first columns inside the GEMV (the hyper-connections' down projection) equals
    the GEMV followed by the scaled_silu kernel on those columns, in every reduction path."""
    from nextserve.ops.triton.hyper import triton_scaled_silu

    x, w = _problem(5, N, K, dtype, seed=13)
    plain = small_m_linear(x, w, splits=splits, one_launch=one_launch)
    fused = small_m_linear(x, w, splits=splits, one_launch=one_launch, silu_cols=8, silu_scale=0.25)
    assert torch.equal(fused[:, 8:], plain[:, 8:])
    assert torch.equal(fused[:, :8], triton_scaled_silu(plain[:, :8], 4))


@small
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_row_strided_input_read_in_place(dtype) -> None:
    """A column slice of a wider tensor (rows 324 apart) gives the bits of its contiguous copy."""
    x, w = _problem(7, 40, 300, dtype, seed=17)
    wide = torch.cat([x, x[:, :24]], dim=1)[:, :300]
    assert wide.stride(0) == 324
    assert torch.equal(small_m_linear(wide, w), small_m_linear(wide.contiguous(), w))


@small
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,H,K", [(4, 16, 40), (4, 64, 300), (2, 40, 24)])
@pytest.mark.usefixtures("row_independent_dot")
def test_mix_epilogue_gives_the_separate_mix_bits(dtype: torch.dtype, n: int, H: int, K: int) -> None:
    """The up projection with the stream mix in its epilogue (its tiles gather each position's n streams)
    equals the GEMV followed by the mix kernel, bit for bit, and a row's bits do not depend on M."""
    from nextserve.ops.triton.gemv import small_m_linear_mix
    from nextserve.ops.triton.hyper import triton_mix_streams

    x, w = _problem(20, n * H, K, dtype, seed=n * H + K)
    xn = torch.randn(20, n * H, generator=torch.Generator().manual_seed(K)).to(device=DEV, dtype=dtype)
    fused = small_m_linear_mix(x, w, xn, n, H)
    assert fused is not None and fused.shape == (20, H)
    assert torch.equal(fused, triton_mix_streams(small_m_linear(x, w), xn, n, H, sigmoid=True))
    for i in (0, 7, 19):
        assert torch.equal(small_m_linear_mix(x[i : i + 1], w, xn[i : i + 1], n, H)[0], fused[i]), i


@small
def test_mix_epilogue_declines_what_it_cannot_tile() -> None:
    """A split K or a tile that is not whole positions' streams returns None; ops.hyper.up_mix then runs
    the GEMV and the mix (their references on CPU tensors)."""
    from nextserve.ops.hyper import mix_streams, up_mix
    from nextserve.ops.linear import linear
    from nextserve.ops.triton.gemv import small_m_linear_mix

    for n, H, K in [(4, 16, 2048), (4, 6, 40)]:  # 16 K tiles: split; 4 positions a tile, 6 positions
        x, w = _problem(3, n * H, K, torch.float32, seed=H)
        xn = torch.randn(3, n * H).to(DEV)
        assert small_m_linear_mix(x, w, xn, n, H) is None
        want = mix_streams(linear(x, w, True), xn, n, H, True)
        assert torch.equal(up_mix(x, w, xn, n, H, row_invariant=True), want)
