"""The 8-bit KV form (ops/kv8.py) and an int8 KV pool: round trip within half a step of each vector's
scale, a vector's stored form independent of its neighbours, Kv8Plane reads and writes as a plane does, the
attention reference on an Kv8Plane equal to it on the dequantized plane, and page copies and host images
that carry the scales."""

from __future__ import annotations

import pytest
import torch

from nextserve.cache.host_store import into_pool, to_host
from nextserve.cache.kv_pool import KVPool, kv_bytes_per_token
from nextserve.config import ModelConfig
from nextserve.engine_config import DEFAULT_MODEL
from nextserve.ops.attention import _index_scores_reference, _paged_sparse_attention_reference
from nextserve.ops.kv8 import CODES, QMAX, Kv8Plane, dequantize_rows, quantize_rows
from nextserve.ops.paged import write_paged_rows


@pytest.mark.parametrize("seed", [0, 152])
def test_round_trip_is_within_half_a_step_of_each_vector(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(50, 4, 64, generator=g) * torch.logspace(-3, 2, 50)[:, None, None]
    q, s = quantize_rows(x)
    assert q.dtype == torch.int8 and s.shape == (50, 4) and int(q.abs().max()) == QMAX
    err = (dequantize_rows(q, s, torch.float32) - x).abs()
    # half a step, plus float32's rounding of x / s and q * s, relative to x (seed 152 has an exact tie, a
    # value 26.5 steps from zero: half a step and 2^-24 of x away; a bound relative to s alone failed it)
    assert (err <= s[..., None] / 2 + x.abs() * 2**-22).all()
    zeros = quantize_rows(torch.zeros(3, 8))
    assert not zeros[0].any() and not zeros[1].any()  # no division by zero: zeros stay zeros
    # C1: a vector's stored form is its own, whatever is quantized beside it
    q1, s1 = quantize_rows(x[7:8])
    assert torch.equal(q1[0], q[7]) and torch.equal(s1[0], s[7])


def test_fp8_codes_are_e4m3_within_2_to_the_minus_4_of_each_value() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 4, 64, generator=g) * torch.logspace(-3, 2, 50)[:, None, None]
    q, s = quantize_rows(x, "fp8")
    assert q.dtype == torch.float8_e4m3fn and s.shape == (50, 4) and float(q.float().abs().max()) == 448
    back = dequantize_rows(q, s, torch.float32)
    # 3 mantissa bits: within 2^-4 of the value, or of E4M3's smallest step (2^-9 of the scale) below 2^-6
    assert ((back - x).abs() <= torch.maximum(x.abs() * 2**-4, s[..., None] * 2**-10) * 1.0001).all()
    assert torch.equal(q.float(), (x / s[..., None]).to(torch.float8_e4m3fn).float())  # ties to even
    q1, s1 = quantize_rows(x[7:8], "fp8")
    assert torch.equal(q1[0].view(torch.int8), q[7].view(torch.int8)) and torch.equal(s1[0], s[7])
    zeros = quantize_rows(torch.zeros(3, 8), "fp8")
    assert not zeros[0].float().any() and not zeros[1].any()


@pytest.mark.parametrize("form", ["int8", "fp8"])
def test_8_bit_plane_reads_and_writes_as_a_plane(form) -> None:
    values, scale = torch.zeros(5, 4, 2, 8, dtype=torch.int8).view(CODES[form]), torch.zeros(5, 4, 2)
    plane = Kv8Plane(values, scale, torch.bfloat16)
    x = torch.randn(3, 2, 8)
    pages, offs = torch.tensor([4, 0, 2]), torch.tensor([1, 3, 0])
    plane[pages, offs] = x
    got = plane[pages, offs]
    assert got.dtype == torch.bfloat16 and got.shape == (3, 2, 8)
    assert torch.equal(got, dequantize_rows(*quantize_rows(x, form), torch.bfloat16))
    y = torch.randn(2, 2, 8)
    write_paged_rows((plane,), (y,), torch.tensor([[1], [3]], dtype=torch.int32), torch.tensor([2, 1]), 4)
    want = dequantize_rows(*quantize_rows(y, form), torch.bfloat16)
    assert torch.equal(plane[torch.tensor([1, 3]), torch.tensor([2, 1])], want)
    assert plane.shape == values.shape and not plane.is_cuda and not plane.is_contiguous()


def test_the_attention_and_indexer_references_read_an_int8_plane_as_its_dequantized_plane() -> None:
    g = torch.Generator().manual_seed(0)
    k, v = (
        Kv8Plane(torch.zeros(6, 4, 2, 16, dtype=torch.int8), torch.zeros(6, 4, 2), torch.float32)
        for _ in "kv"
    )
    keys = Kv8Plane(torch.zeros(6, 2, 8, dtype=torch.int8), torch.zeros(6, 2), torch.float32)
    all_pages = torch.arange(6)
    for p in range(4):
        k[all_pages, torch.full((6,), p)] = torch.randn(6, 2, 16, generator=g)
        v[all_pages, torch.full((6,), p)] = torch.randn(6, 2, 16, generator=g)
    for b in range(2):
        keys[all_pages, torch.full((6,), b)] = torch.randn(6, 8, generator=g)
    dense = [t[all_pages] for t in (k, v, keys)]  # every page dequantized
    q = torch.randn(2, 4, 16, generator=g)
    table = torch.tensor([[3, 1, 5], [0, 2, 4]], dtype=torch.int32)
    tokens = torch.tensor([[0, 5, 9, -1], [2, 3, 11, 7]], dtype=torch.int32)
    got = _paged_sparse_attention_reference(q, k, v, table, tokens, 0.25)
    assert torch.equal(got, _paged_sparse_attention_reference(q, dense[0], dense[1], table, tokens, 0.25))
    qi, nb = torch.randn(2, 3, 8, generator=g), torch.tensor([4, 6])
    got = _index_scores_reference(qi, keys, table, nb, 6)
    assert torch.equal(got, _index_scores_reference(qi, dense[2], table, nb, 6))


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_dir(DEFAULT_MODEL)


@pytest.mark.parametrize("form", ["int8", "fp8"])
def test_an_8_bit_pool_holds_its_scales_and_copies_them(cfg, form) -> None:
    pool = KVPool(cfg, 2, 6, 16, torch.bfloat16, kv_dtype=form)
    wide = KVPool(cfg, 2, 6, 16, torch.bfloat16)
    assert pool.k.dtype == pool.v.dtype == pool.block_keys.dtype == torch.int8
    assert [s.shape for s in pool.scales] == [
        pool.k.shape[:-1],
        pool.v.shape[:-1],
        pool.block_keys.shape[:-1],
    ]
    assert abs(pool.page_bytes / 16 - kv_bytes_per_token(cfg, 2, torch.bfloat16, form)) <= 1
    assert pool.page_bytes < 0.56 * wide.page_bytes
    k, v, keys = pool.planes(1)
    assert isinstance(k, Kv8Plane) and k.dtype == torch.bfloat16 and k.values.dtype == CODES[form]
    x = torch.randn(2, *pool.k.shape[-2:])
    k[torch.tensor([3, 3]), torch.tensor([0, 5])] = x
    pool.copy_page(3, 4)
    assert torch.equal(
        k[torch.tensor([4, 4]), torch.tensor([0, 5])], k[torch.tensor([3, 3]), torch.tensor([0, 5])]
    )
    assert torch.equal(pool.scales[0][:, 4], pool.scales[0][:, 3]) and pool.scales[0][1, 4, 0].abs().sum() > 0
    # a host image of pages carries the scales and restores them bit for bit
    host = to_host(pool, 32, {}, [3, 1])
    assert len(host.planes) == 6 and host.nbytes == 2 * pool.page_bytes
    into_pool(pool, [0, 2], host)
    for t in pool.page_planes():
        assert torch.equal(t[:, [0, 2]], t[:, [3, 1]])
    with pytest.raises(ValueError, match="kv_dtype"):
        KVPool(cfg, 2, 6, 16, torch.bfloat16, kv_dtype="int4")
