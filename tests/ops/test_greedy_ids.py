"""The greedy argmax of logits rows (ops/triton/tokens.py, in Triton's interpreter without a GPU): equal
to torch.argmax on the CPU, with ties across and within chunks (the first index wins), a NaN, rows of
-inf, and the tile counters left zero."""

import pytest
import torch
from triton_interp import DEV, needs_cuda, small

from nextserve.ops.tokens import greedy_ids
from nextserve.ops.triton.common import tile_counters
from nextserve.ops.triton.tokens import ARGMAX_BLOCK, triton_greedy_ids

gpu = pytest.mark.gpu


def _logits(M: int, V: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, V, generator=g).to(dtype)
    B = ARGMAX_BLOCK
    x[0, [5, B + 7, 2 * B + 1]] = 9.0  # a tie across chunks: the first chunk's wins
    x[1, [B + 3, B + 4]] = 9.0  # a tie within a chunk
    x[2, V - 1] = 9.0  # the last, partial chunk
    x[3] = float("-inf")  # all -inf: index 0
    x[4, B + 9] = float("nan")  # NaN counts as the largest
    return x


def _check(M: int, V: int, dtype: torch.dtype, device) -> None:
    x = _logits(M, V, dtype, M + V)
    want = torch.argmax(x, dim=-1)
    out = torch.full((M,), -5, dtype=torch.int64, device=device)
    assert triton_greedy_ids(x.to(device), out)
    assert torch.equal(out.cpu(), want), (out.cpu(), want)
    assert int(tile_counters(torch.device(device)).abs().sum()) == 0


@small
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_torch_argmax(dtype: torch.dtype) -> None:
    _check(6, 2 * ARGMAX_BLOCK + 100, dtype, DEV)


@small
def test_one_chunk_and_column_slices() -> None:
    x = torch.randn(3, 1000)
    x[1, [10, 20]] = 9.0
    out = torch.empty(3, dtype=torch.int64, device=DEV)
    assert torch.equal(greedy_ids(x.to(DEV), out).cpu(), torch.argmax(x, dim=-1))
    x = _logits(5, 3 * ARGMAX_BLOCK, torch.float32, 1)
    out = torch.empty(5, dtype=torch.int64, device=DEV)
    got = greedy_ids(x.to(DEV)[:, 10:], out)  # a row stride wider than the row
    assert torch.equal(got.cpu(), torch.argmax(x[:, 10:], dim=-1))


def test_cpu_path_is_torch_argmax() -> None:
    x = _logits(5, 2 * ARGMAX_BLOCK + 3, torch.float32, 2)
    out = torch.empty(5, dtype=torch.int64)
    assert greedy_ids(x, out) is out and torch.equal(out, torch.argmax(x, dim=-1))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_torch_argmax(dtype: torch.dtype) -> None:
    """The real vocabulary (248320) at 1 and 40 rows, on the GPU."""
    for M in (5, 40):
        _check(M, 248320, dtype, "cuda")
