"""The row-invariant Triton GEMM against its reference (F.linear) and against itself at other M, on
shapes with one K split and with several (small N: (4, 10240), (1, 2560), (48, 2560), (320, 10240)),
and inside a CUDA graph."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [(257, 320), (2560, 10240), (640, 2560), (4, 2560), (4, 10240), (1, 2560), (48, 2560), (320, 10240),
     (324, 10240), (2560, 6144), (6144, 2560), (2560, 640), (10240, 320)],
)  # fmt: skip
def test_matches_reference_and_rows_are_invariant(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    from nextserve.ops.triton.gemv import small_m_linear

    N, K = shape
    g = torch.Generator(device="cuda").manual_seed(N + K)
    w = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).to(dtype)
    x = torch.randn(40, K, device="cuda", generator=g).to(dtype)
    full = small_m_linear(x, w)
    ref = torch.nn.functional.linear(x.double(), w.double())
    rel = ((full.double() - ref).norm() / ref.norm()).item()
    assert rel < TOL[dtype], rel
    for m in (1, 2, 5, 16, 17, 33):
        part = small_m_linear(x[:m].clone(), w)
        assert torch.equal(part, full[:m]), m
    for i in (0, 7, 39):  # a row alone, from an unaligned view
        assert torch.equal(small_m_linear(x[i : i + 1], w)[0], full[i])


@pytest.mark.parametrize("shape", [(4, 10240), (10240, 320)])  # several splits; one
def test_config_and_cuda_graph(shape: tuple[int, int]) -> None:
    """The split count comes from the weight alone, and a captured call replays to the same bits."""
    from nextserve.ops.triton.gemv import small_m_linear
    from nextserve.ops.triton.gemv_config import gemv_config

    N, K = shape
    assert (gemv_config(N, K, torch.bfloat16).splits > 1) == (N == 4)
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(torch.bfloat16)
    x = torch.randn(8, K, device="cuda").to(torch.bfloat16)
    eager = small_m_linear(x, w)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        small_m_linear(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = small_m_linear(x, w)
    x.copy_(torch.randn(8, K, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, small_m_linear(x, w))
    assert not torch.equal(out, eager)


@pytest.mark.parametrize("shape", [(324, 10240), (320, 10240), (2560, 6144), (1793, 2560), (4, 10240)])
def test_one_launch_split_reduction(shape: tuple[int, int]) -> None:
    """The tile's last program adds the K splits: the bits of the two-launch reduction, at every M,
    call after call (the counters reset), and in a graph replayed several times."""
    from nextserve.ops.triton.common import tile_counters
    from nextserve.ops.triton.gemv import small_m_linear
    from nextserve.ops.triton.gemv_config import gemv_config

    N, K = shape
    assert gemv_config(N, K, torch.bfloat16).splits > 1
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(torch.bfloat16)
    for M in (1, 8, 32, 40):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        two = small_m_linear(x, w, one_launch=False)
        for _ in range(3):
            assert torch.equal(small_m_linear(x, w), two), M
    assert int(tile_counters(x.device).abs().sum()) == 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = small_m_linear(x, w)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, small_m_linear(x, w, one_launch=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mix_epilogue_gives_the_separate_mix_bits(dtype: torch.dtype) -> None:
    """The hyper-connections' up projection with the stream mix in its epilogue (real widths: 4 streams of
    2560, rank 320) equals the GEMV then the mix kernel (bit for bit in 16-bit dtypes), and its rows are
    invariant at every M, alone and in batches, eagerly and replayed from a CUDA graph with PDL."""
    from nextserve.ops.pdl import pdl_mode
    from nextserve.ops.triton.gemv import small_m_linear, small_m_linear_mix
    from nextserve.ops.triton.hyper import triton_mix_streams

    n, H, K = 4, 2560, 320
    g = torch.Generator(device="cuda").manual_seed(5)
    w = (torch.randn(n * H, K, device="cuda", generator=g) / K**0.5).to(dtype)
    x = torch.randn(40, K, device="cuda", generator=g).to(dtype)
    xn = torch.randn(40, n * H, device="cuda", generator=g).to(dtype)
    unfused = triton_mix_streams(small_m_linear(x, w), xn, n, H, sigmoid=True)
    plain = small_m_linear_mix(x, w, xn, n, H)
    if dtype == torch.float32:
        # NOTE: in float32 nothing is rounded between the product and the sum, so the compiler may contract
        # them into one FMA in one kernel and not in the other: equal to rounding, not bit for bit
        assert ((plain - unfused).norm() / unfused.norm()).item() < 1e-6
    else:
        assert torch.equal(plain, unfused)
    for m in (1, 2, 5, 16, 17, 33):
        assert torch.equal(small_m_linear_mix(x[:m].clone(), w, xn[:m].clone(), n, H), plain[:m]), m
    for i in (0, 7, 39):
        assert torch.equal(small_m_linear_mix(x[i : i + 1], w, xn[i : i + 1], n, H)[0], plain[i])
    out = torch.empty_like(plain[:8])
    with pdl_mode(True):
        small_m_linear_mix(x[:8], w, xn[:8], n, H)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(small_m_linear_mix(x[:8], w, xn[:8], n, H))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain[:8])
