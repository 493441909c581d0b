"""Decode steps replayed as CUDA graphs give the eager step's bits, in every bucket (C1)."""

import pytest
import torch
from pool_check import assert_pool_full

from nextserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, top_k=40, seed=7, ignore_eos=True, logprobs=1)


def _prompts(n: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(8, 250, (int(k),), generator=g).tolist() for k in torch.randint(3, 150, (n,))]


def _flags(dtype: str, **kw) -> dict:
    return (
        dict(device="cuda", dtype=dtype, prefill_chunk=32, page_size=16, kv_capacity=8192, max_context=512)
        | kw
    )


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert [lp.logprob for lp in x.logprobs] == [lp.logprob for lp in y.logprobs]
        assert [lp.top for lp in x.logprobs] == [lp.top for lp in y.logprobs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_graphs_equal_eager_and_alone(small_model_dir, dtype: str, params: SamplingParams) -> None:
    prompts = _prompts()
    graphed = LLM(small_model_dir, max_concurrency=12, **_flags(dtype)).generate(prompts, params)
    eager = LLM(small_model_dir, max_concurrency=12, cuda_graph=False, **_flags(dtype)).generate(
        prompts, params
    )
    _same(graphed, eager)
    solo = LLM(small_model_dir, max_concurrency=1, **_flags(dtype))
    _same(graphed, [solo.generate([p], params)[0] for p in prompts])
    assert_pool_full(solo)


def test_cuda_decode_close_to_cpu(oracle_model_dir) -> None:
    """The GPU decode kernels against the CPU reference ops, float32, over 24 decode steps that cross
    indexer block boundaries."""
    flags = dict(dtype="float32", prefill_chunk=16, kv_capacity=2048, max_context=256, max_concurrency=2)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)
    prompts = _prompts(2)
    cpu = LLM(oracle_model_dir, device="cpu", **flags).generate(prompts, params)
    gpu = LLM(oracle_model_dir, device="cuda", **flags).generate(prompts, params)
    for c, g in zip(cpu, gpu, strict=True):
        assert c.token_ids == g.token_ids
        for a, b in zip(c.logprobs, g.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-3
