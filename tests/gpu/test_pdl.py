"""Programmatic dependent launch changes when kernels start, never what they compute: the same tokens and
logprobs on or off, graphs or eager (C1), on a small model whose kernels are short enough to overlap."""

import pytest
import torch

from nextserve import LLM, SamplingParams
from nextserve.ops.pdl import set_pdl
from nextserve.ops.triton.common import launch_pdl
from nextserve.ops.triton.gemv import small_m_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=3)


def _prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(8, 250, (int(k),), generator=g).tolist() for k in torch.randint(3, 150, (n,))]


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graphs", "eager"])
def test_pdl_on_equals_off(small_model_dir, cuda_graph: bool) -> None:
    flags = dict(device="cuda", dtype="bfloat16", prefill_chunk=32, page_size=16, kv_capacity=8192)
    flags |= dict(max_context=512, max_concurrency=8, cuda_graph=cuda_graph)
    prompts = _prompts()
    on = LLM(small_model_dir, pdl=True, **flags).generate(prompts, PARAMS)
    off = LLM(small_model_dir, pdl=False, **flags).generate(prompts, PARAMS)
    for a, b in zip(on, off, strict=True):
        assert a.token_ids == b.token_ids
        assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]
        assert [lp.top for lp in a.logprobs] == [lp.top for lp in b.logprobs]


def test_chained_gemvs_in_a_graph() -> None:
    """Each GEMV reads the one before it (split-K with the in-launch reduction and without splits): a
    kernel that started before its input was written would change the result."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    g = torch.Generator(device="cuda").manual_seed(0)
    dims = [320, 10240, 324, 2560, 1793, 640, 2560, 320] * 3
    ws = [
        torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) / k**0.5
        for k, n in zip(dims, dims[1:], strict=False)
    ]
    x = torch.randn(3, 320, device="cuda", generator=g, dtype=torch.bfloat16)

    def chain(inp):
        for w in ws:
            inp = small_m_linear(inp, w)
        return inp

    try:
        set_pdl(False)
        ref = chain(x)
        set_pdl(True)
        assert launch_pdl(x)
        chain(x)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(x)
        for _ in range(20):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ref)
    finally:
        set_pdl(False)
