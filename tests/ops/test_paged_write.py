"""Rows written into paged planes (ops/triton/paged.py, in Triton's interpreter without a GPU): the planes
equal the torch reference's (ops/paged.write_paged_rows) bit for bit, for K and V pages (two planes) and
block keys (one plane, one entry per `unit` positions), with values that are column slices and padding rows
on a scratch page."""

import pytest
import torch
from triton_interp import DEV, needs_cuda, small

from nextserve.ops import paged
from nextserve.ops.triton.paged import triton_write_paged_rows

gpu = pytest.mark.gpu


def _case(B: int, pages: int, per_page: int, entry: tuple[int, ...], unit: int, dtype, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    width = int(torch.tensor(entry).prod())
    planes = tuple(torch.randn(pages, per_page, *entry, generator=g).to(dtype) for _ in range(2))
    values = tuple(
        torch.randn(B, width + 8, generator=g).to(dtype)[:, 8:].reshape(B, *entry)  # column slices
        for _ in range(2)
    )
    max_pages = (pages - 1) // B
    table = torch.randperm(pages - 1, generator=g)[: B * max_pages].view(B, max_pages).int()  # own pages
    positions = torch.randint(0, max_pages * per_page * unit, (B,), generator=g)
    table[-2:] = pages - 1  # padding rows: the scratch page, position 0
    positions[-2:] = 0
    move = lambda ts: tuple(t.to(device) for t in ts)  # noqa: E731
    return move(planes), move(values), table.to(device), positions.to(device)


def _check(n_planes: int, entry: tuple[int, ...], unit: int, dtype, device, seed: int = 0) -> None:
    B, pages, per_page = 7, 43, 4
    planes, values, table, positions = _case(B, pages, per_page, entry, unit, dtype, seed, device)
    planes, values = planes[:n_planes], values[:n_planes]
    want = tuple(p.cpu().clone() for p in planes)
    # the reference, run on the CPU (no kernel there)
    paged.write_paged_rows(want, tuple(v.cpu() for v in values), table.cpu(), positions.cpu(), per_page, unit)
    triton_write_paged_rows(planes, values, table, positions, per_page, unit)
    for got, ref in zip(planes, want, strict=True):
        assert torch.equal(got[:-1].cpu(), ref[:-1])  # the scratch page's rows are any padding row's


@small
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_pages_match_reference(dtype) -> None:
    _check(2, (2, 16), 1, dtype, DEV)


@small
def test_block_keys_match_reference() -> None:
    _check(1, (32,), 4, torch.float32, DEV, seed=1)


@small
def test_entries_wider_than_one_block() -> None:
    _check(2, (3, 700), 1, torch.float32, DEV, seed=2)  # 2100 > 1024: three column blocks


def test_reference_writes_each_rows_address() -> None:
    """The reference: entry i = positions // unit at page table[b, i // per_page], offset i % per_page."""
    plane = torch.zeros(5, 2, 3)
    table = torch.tensor([[3, 1], [4, 0]], dtype=torch.int32)
    paged.write_paged_rows((plane,), (torch.ones(2, 3) * torch.tensor([[1.0], [2.0]]),), table,
                           torch.tensor([7, 2]), 2, 2)  # fmt: skip
    # row 0: entry 3 -> page table[0, 1] = 1, offset 1; row 1: entry 1 -> page table[1, 0] = 4, offset 1
    assert torch.equal(plane[1, 1], torch.ones(3)) and torch.equal(plane[4, 1], 2 * torch.ones(3))
    assert plane.sum() == 9


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_reference(dtype) -> None:
    """The real widths: K/V entries of 2 x 256, block keys of 128, on the GPU."""
    _check(2, (2, 256), 1, dtype, "cuda")
    _check(1, (128,), 4, dtype, "cuda", seed=3)


def _int8_case(entry: tuple[int, ...], unit: int, device, seed: int = 0, form: str = "int8"):
    """8-bit planes (values and scales, as the pool lays them out) and 16-bit rows to write."""
    from nextserve.ops.kv8 import CODES, Kv8Plane

    B, pages, per_page = 7, 43, 4
    f16, values, table, positions = _case(B, pages, per_page, entry, unit, torch.bfloat16, seed, device)
    values = tuple(v * torch.logspace(-4, 3, B, device=device)[:, *[None] * len(entry)] for v in values)
    values = tuple(v.to(torch.bfloat16) for v in values)
    planes = tuple(
        Kv8Plane(
            torch.zeros(p.shape, dtype=torch.int8, device=device).view(CODES[form]),
            torch.zeros(p.shape[:-1], device=device),
            p.dtype,
        )
        for p in f16
    )
    return planes, values, table, positions, per_page


@small
@pytest.mark.parametrize("entry,unit", [((2, 16), 1), ((4, 256), 1), ((64,), 8)])
@pytest.mark.parametrize("form", ["int8", "fp8"])
def test_8_bit_planes_match_reference(entry, unit, form) -> None:
    """The kernel's quantized writes (values and scales) equal ops/kv8.quantize_rows's through the torch
    path, rows of five decades of magnitude and zero rows included."""
    from nextserve.ops.triton.paged import triton_write_paged_kv8

    planes, values, table, positions, per_page = _int8_case(entry, unit, DEV, form=form)
    values[0][2] = 0  # an all-zero row: scale 0, codes 0
    want, _, _, _, _ = _int8_case(entry, unit, "cpu", form=form)
    paged.write_paged_rows(want, tuple(v.cpu() for v in values), table.cpu(), positions.cpu(), per_page, unit)
    triton_write_paged_kv8(planes, values, table, positions, per_page, unit)
    for got, ref in zip(planes, want, strict=True):
        assert torch.equal(got.values[:-1].view(torch.int8).cpu(), ref.values[:-1].view(torch.int8))
        assert torch.equal(got.scale[:-1].cpu(), ref.scale[:-1])
    assert planes[0].scale.count_nonzero() > 0


@gpu
@needs_cuda
def test_write_paged_rows_sends_int8_planes_to_the_kernel(monkeypatch) -> None:
    from nextserve.ops import kv8

    planes, values, table, positions, per_page = _int8_case((2, 16), 1, "cuda")
    monkeypatch.setattr(kv8, "quantize_rows", lambda *a: pytest.fail("the torch quantization ran"))
    paged.write_paged_rows(planes, values, table, positions, per_page)
    assert planes[0].values.count_nonzero() > 0
