"""The QSA kernels on 8-bit KV planes (ops/triton/kv_int8.py): each kernel reading an Int8Plane gives, bit
for bit, what it gives on the plane dequantized in PyTorch (ops/kv_int8.dequantize_rows): the decode
indexer scores, the decode attention (split and direct), a prefill chunk's attention and its indexer scores.
In Triton's interpreter on CPU tensors without a GPU, on CUDA with one."""

from __future__ import annotations

import pytest
import torch
from test_qsa_decode import TINY, _tokens, make_paged
from triton_interp import DEV, INTERPRET, small

from nextserve.ops.attention import PREFILL_TILE
from nextserve.ops.kv_int8 import Int8Plane, quantize_rows
from nextserve.ops.triton.qsa_decode import triton_index_scores, triton_paged_sparse_attention
from nextserve.ops.triton.qsa_prefill import triton_prefill_index_scores

DTYPES = [torch.float32] if INTERPRET else [torch.bfloat16, torch.float32]
HERE = [pytest.param("here", marks=[] if INTERPRET else [pytest.mark.gpu])]


def _int8(plane: torch.Tensor) -> tuple[Int8Plane, torch.Tensor]:
    """An Int8Plane of `plane` and that Int8Plane read back whole (the dense plane the kernel must match)."""
    q = Int8Plane(*quantize_rows(plane), plane.dtype)
    return q, q[torch.arange(plane.shape[0], device=plane.device)]


def _paged(dtype: torch.dtype, seed: int):
    p = make_paged([1, 5, 8, 17, 40, 77, 90], TINY, dtype=dtype, device=DEV, seed=seed)
    return p, _int8(p.k_plane), _int8(p.v_plane), _int8(p.key_plane)


@small
@pytest.mark.parametrize("where", HERE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_index_scores_read_int8_keys(where, dtype) -> None:
    p, _, _, (keys8, keys) = _paged(dtype, 0)
    args = (p.block_table, p.n_blocks, p.max_blocks)
    got = triton_index_scores(p.q_idx, keys8, *args)
    assert torch.equal(got, triton_index_scores(p.q_idx, keys, *args))
    assert not torch.equal(got, triton_index_scores(p.q_idx, p.key_plane, *args))  # the 8-bit values


@small
@pytest.mark.parametrize("where", HERE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiling", [(16, 32), (16, 1), (PREFILL_TILE, 1)], ids=["split", "direct", "prefill"])
def test_attention_reads_int8_k_and_v(where, dtype, tiling) -> None:
    p, (k8, k), (v8, v), _ = _paged(dtype, 1)
    tokens = _tokens(p, 4).to(DEV)
    scaling = TINY["d"] ** -0.5
    tile, splits = tiling
    got = triton_paged_sparse_attention(
        p.q, k8, v8, p.block_table, tokens, scaling, tile=tile, num_splits=splits
    )
    want = triton_paged_sparse_attention(
        p.q, k, v, p.block_table, tokens, scaling, tile=tile, num_splits=splits
    )
    assert torch.equal(got, want)
    wide = triton_paged_sparse_attention(
        p.q, p.k_plane, p.v_plane, p.block_table, tokens, scaling, tile=tile, num_splits=splits
    )
    assert not torch.equal(got, wide)  # the 8-bit values


@small
@pytest.mark.parametrize("where", HERE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start,T", [(0, 40), (24, 66)])
def test_prefill_index_scores_read_int8_keys(where, dtype, start, T) -> None:
    p, _, _, (keys8, keys) = _paged(dtype, 2)
    g = torch.Generator().manual_seed(3)
    q_idx = torch.randn(T, TINY["ni"], TINY["di"], generator=g).to(device=DEV, dtype=dtype)
    table = p.block_table[-1]
    got = triton_prefill_index_scores(q_idx, keys8, table, start, TINY["c"])
    assert torch.equal(got, triton_prefill_index_scores(q_idx, keys, table, start, TINY["c"]))
