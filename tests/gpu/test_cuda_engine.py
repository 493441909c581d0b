"""The engine on a CUDA device (run on the GPU machine: pytest -m gpu tests/gpu)."""

import pytest
import torch

from nextserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(8, 500, (n,), generator=g).tolist() for n in (5, 37, 70, 101, 140)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_equals_alone_on_cuda(tiny_model_dir, dtype: str) -> None:
    """C1 on the GPU backend: tokens and logprobs of a batch equal each request run alone."""
    flags = dict(
        device="cuda", dtype=dtype, prefill_chunk=32, page_size=16, kv_capacity=4096, max_context=1024
    )
    batched = LLM(tiny_model_dir, max_concurrency=8, **flags).generate(_prompts(), GREEDY)
    solo = LLM(tiny_model_dir, max_concurrency=1, **flags)
    for prompt, out in zip(_prompts(), batched, strict=True):
        (alone,) = solo.generate([prompt], GREEDY)
        assert out.token_ids == alone.token_ids
        assert [lp.logprob for lp in out.logprobs] == [lp.logprob for lp in alone.logprobs]
    s = solo.stats()
    assert s["kv_pages_free"] == s["kv_pages_total"]


def test_cuda_float32_logits_close_to_cpu(tiny_model_dir) -> None:
    flags = dict(dtype="float32", prefill_chunk=32, kv_capacity=2048, max_context=1024, max_concurrency=1)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    prompt = _prompts()[3]
    (cpu,) = LLM(tiny_model_dir, device="cpu", **flags).generate([prompt], params)
    (gpu,) = LLM(tiny_model_dir, device="cuda", **flags).generate([prompt], params)
    assert cpu.token_ids == gpu.token_ids
    for (ti, a), (tj, b) in zip(cpu.logprobs[0].top, gpu.logprobs[0].top, strict=True):
        assert ti == tj and abs(a - b) < 1e-3
