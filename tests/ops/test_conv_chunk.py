"""A prefill chunk's causal conv (ops/conv.py conv_chunk): the Triton kernel (Triton's interpreter on the
CPU; CUDA at the GDN's size) against `causal_conv` + SiLU, its new history, and the history left alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interp import needs_cuda

from nextserve.ops.conv import causal_conv, conv_chunk
from nextserve.ops.triton.conv_chunk import triton_conv_chunk

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _inputs(T: int, C: int, K: int, dil: int, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, C + 5, generator=g)[:, :C].to(dtype).to(device)  # a column slice: row stride C + 5
    hist = torch.randn(C, (K - 1) * dil, generator=g).to(dtype).to(device)
    w = (torch.randn(C, K, generator=g) / K).to(dtype).to(device)
    return x, hist, w


def _reference(x, hist, w, dil, silu):
    out, new = causal_conv(x.cpu().float(), hist.cpu().float(), w.cpu().float(), dil)
    return (F.silu(out) if silu else out), new


@pytest.mark.parametrize(
    "T,dil,silu",
    [(1, 1, True), (2, 1, False), (3, 1, True), (37, 1, True), (20, 3, False), (40, 7, True)],
)  # (40, 7): the history (21 rows) reaches the second row tile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_chunk_kernel_vs_reference(T: int, dil: int, silu: bool, dtype) -> None:
    C, K = 300, 4  # C: a partial channel tile
    x, hist, w = _inputs(T, C, K, dil, dtype, seed=T)
    before = hist.clone()
    got = triton_conv_chunk(x, hist, w, dil, silu)
    ref, _ = _reference(x, hist, w, dil, silu)
    torch.testing.assert_close(got.float(), ref, rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(hist, before)


@pytest.mark.parametrize("T", [1, 2, 3, 9])
def test_conv_chunk_new_history_is_the_references(T: int, monkeypatch) -> None:
    """conv_chunk's kernel branch (forced on the CPU tensors) returns causal_conv's new history."""
    import nextserve.ops.conv as conv

    x, hist, w = _inputs(T, 40, 4, 1, torch.float32, seed=3)
    want_out, want_hist = conv_chunk(x, hist, w, 1, silu=True)  # the CPU path: the reference
    monkeypatch.setattr(conv, "use_kernel", lambda *ts: True)
    got_out, got_hist = conv_chunk(x, hist, w, 1, silu=True)
    assert torch.equal(got_hist, want_hist)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 3, 4096])
def test_cuda_conv_chunk_gdn_size(T: int) -> None:
    x, hist, w = _inputs(T, 10240, 4, 1, torch.bfloat16, device="cuda", seed=5)
    out, new = conv_chunk(x, hist, w, 1, silu=True)
    ref, ref_hist = _reference(x, hist, w, 1, True)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(new.float().cpu(), ref_hist)
    again, _ = conv_chunk(x, hist, w, 1, silu=True)
    assert torch.equal(again, out)  # a chunk's result is the chunk's
    if T > 1:  # a row's bits do not depend on the chunk's other rows
        tail, _ = conv_chunk(x[-1:], torch.cat([hist, x[:-1].t()], 1)[:, -3:], w, 1, silu=True)
        assert torch.equal(tail[0], out[-1])


def _parts_equal_plain(x, hist, w, parts) -> None:
    plain, plain_hist = conv_chunk(x, hist, w, 1, silu=True)
    got, got_hist = conv_chunk(x, hist, w, 1, silu=True, parts=parts)
    assert torch.equal(got_hist, plain_hist)
    assert [p.shape[1] for p in got] == list(parts) and all(p.is_contiguous() for p in got)
    assert torch.equal(torch.cat(got, dim=1), plain)


@pytest.mark.parametrize("T", [1, 5, 37])
def test_conv_chunk_parts_are_the_outputs_columns(T: int, monkeypatch) -> None:
    """`parts` (the GDN's q | k | v) stores each column range contiguous, with the plain output's bits:
    the reference path, and the kernel (Triton's interpreter) with widths that do not fill a tile."""
    import nextserve.ops.conv as conv

    x, hist, w = _inputs(T, 300, 4, 1, torch.float32, seed=7)
    _parts_equal_plain(x, hist, w, (64, 64, 172))  # the reference
    monkeypatch.setattr(conv, "use_kernel", lambda *ts: True)
    _parts_equal_plain(x, hist, w, (64, 64, 172))
    _parts_equal_plain(x, hist, w, (100, 30, 170))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 3, 4096])
def test_cuda_conv_chunk_parts_gdn_size(T: int) -> None:
    x, hist, w = _inputs(T, 10240, 4, 1, torch.bfloat16, device="cuda", seed=6)
    _parts_equal_plain(x, hist, w, (2048, 2048, 6144))


def _both_forms(monkeypatch, x, hist, w, parts):
    """The kernel's output with the row walk (`_conv_rows`) and with the row tiles (`_conv_chunk`)."""
    import nextserve.ops.triton.conv_chunk as kernel

    walked = triton_conv_chunk(x, hist, w, 1, True, parts)
    monkeypatch.setattr(kernel, "ROWS", 0)
    tiled = triton_conv_chunk(x, hist, w, 1, True, parts)
    return walked, tiled


@pytest.mark.parametrize("T", [1, 2, 5, 36, 70])
@pytest.mark.parametrize("parts", [None, (64, 64, 172)])
def test_conv_rows_walk_gives_the_tiles_bits(T: int, parts, monkeypatch) -> None:
    """The GDN's conv (K = 4, dilation 1) walks rows; each output has the row tiles' bits, whatever the
    chunk length (row blocks of 32: 36 and 70 end inside one, 1 and 2 reach back into the history)."""
    x, hist, w = _inputs(T, 300, 4, 1, torch.bfloat16, seed=11 + T)
    walked, tiled = _both_forms(monkeypatch, x, hist, w, parts)
    if parts is None:
        walked, tiled = [walked], [tiled]
    assert all(torch.equal(a, b) for a, b in zip(walked, tiled, strict=True))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 3, 4096, 4100])
def test_cuda_conv_rows_walk_gives_the_tiles_bits(T: int, monkeypatch) -> None:
    x, hist, w = _inputs(T, 10240, 4, 1, torch.bfloat16, device="cuda", seed=8)
    walked, tiled = _both_forms(monkeypatch, x, hist, w, (2048, 2048, 6144))
    assert all(torch.equal(a, b) for a, b in zip(walked, tiled, strict=True))
