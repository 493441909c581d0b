"""The row-invariant Triton GEMM against its reference (F.linear) and against itself at other M."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(257, 320), (2560, 10240), (640, 2560), (4, 2560)])
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
