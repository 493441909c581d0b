"""The QSA kernels on 8-bit KV planes (ops/triton/kv8.py), int8 and fp8: each kernel reading a Kv8Plane
gives, bit for bit, what it gives on the plane dequantized in PyTorch (ops/kv8.dequantize_rows): the decode
indexer scores (on a GPU: close, see its NOTE), the decode attention (split and direct), a prefill chunk's
attention and its indexer scores. In Triton's interpreter on CPU tensors without a GPU, on CUDA with one."""

from __future__ import annotations

import pytest
import torch
from test_qsa_decode import TINY, _tokens, make_paged
from triton_interp import DEV, INTERPRET, small

from nextserve.ops.attention import PREFILL_TILE
from nextserve.ops.kv8 import Kv8Plane, quantize_rows
from nextserve.ops.triton.qsa_decode import triton_index_scores, triton_paged_sparse_attention
from nextserve.ops.triton.qsa_prefill import triton_prefill_index_scores

DTYPES = [torch.float32] if INTERPRET else [torch.bfloat16, torch.float32]
HERE = [pytest.param("here", marks=[] if INTERPRET else [pytest.mark.gpu])]


FORMS = ["int8", "fp8"]


def _kv8(plane: torch.Tensor, form: str) -> tuple[Kv8Plane, torch.Tensor]:
    """A Kv8Plane of `plane` and that Kv8Plane read back whole (the dense plane the kernel must match)."""
    q = Kv8Plane(*quantize_rows(plane, form), plane.dtype)
    return q, q[torch.arange(plane.shape[0], device=plane.device)]


def _paged(dtype: torch.dtype, seed: int, form: str):
    p = make_paged([1, 5, 8, 17, 40, 77, 90], TINY, dtype=dtype, device=DEV, seed=seed)
    return p, _kv8(p.k_plane, form), _kv8(p.v_plane, form), _kv8(p.key_plane, form)


@small
@pytest.mark.parametrize("where", HERE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
def test_decode_index_scores_read_8_bit_keys(where, dtype, form) -> None:
    p, _, _, (keys8, keys) = _paged(dtype, 0, form)
    args = (p.block_table, p.n_blocks, p.max_blocks)
    got = triton_index_scores(p.q_idx, keys8, *args)
    want = triton_index_scores(p.q_idx, keys, *args)
    if INTERPRET:
        assert torch.equal(got, want)
    else:
        # NOTE: on a GPU the kernel's dot takes the dequantized keys from registers and the 16-bit plane's
        # from memory, which the compiler lowers differently (ops/fp8.py's NOTE): not the same bits on an
        # H100 in bf16 or float32 (TF32), so close here; C1 holds among modes of one KV dtype either way
        finite = want.isfinite()
        assert torch.equal(got.isfinite(), finite)
        assert (got[finite] - want[finite]).abs().max() <= 1e-2 * want[finite].abs().max()
    assert not torch.equal(got, triton_index_scores(p.q_idx, p.key_plane, *args))  # the 8-bit values


@small
@pytest.mark.parametrize("where", HERE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiling", [(16, 32), (16, 1), (PREFILL_TILE, 1)], ids=["split", "direct", "prefill"])
@pytest.mark.parametrize("form", FORMS)
def test_attention_reads_8_bit_k_and_v(where, dtype, tiling, form) -> None:
    p, (k8, k), (v8, v), _ = _paged(dtype, 1, form)
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
@pytest.mark.parametrize("form", FORMS)
def test_prefill_index_scores_read_8_bit_keys(where, dtype, start, T, form) -> None:
    p, _, _, (keys8, keys) = _paged(dtype, 2, form)
    g = torch.Generator().manual_seed(3)
    q_idx = torch.randn(T, TINY["ni"], TINY["di"], generator=g).to(device=DEV, dtype=dtype)
    table = p.block_table[-1]
    got = triton_prefill_index_scores(q_idx, keys8, table, start, TINY["c"])
    assert torch.equal(got, triton_prefill_index_scores(q_idx, keys, table, start, TINY["c"]))
