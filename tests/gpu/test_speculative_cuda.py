"""Speculative decoding on the GPU: a verify window's rows get serial decode's bits (decode replayed as
CUDA graphs, the window eager), and a speculating engine gives the serial reference's outputs (C1)."""

import pytest
import torch
from spec_cases import OracleProposer, check_window_rows, same, spec_prompts

from nextserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FLAGS = dict(
    device="cuda", dtype="bfloat16", prefill_chunk=16, page_size=16, kv_capacity=4096, max_concurrency=3
)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_window_rows_equal_serial_decode(small_model_dir, dtype: str) -> None:
    check_window_rows(small_model_dir, FLAGS | {"dtype": dtype})


@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2),
     SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=5, ignore_eos=True, logprobs=1)],
    ids=["greedy", "seeded"],
)  # fmt: skip
def test_speculation_gives_the_serial_outputs(small_model_dir, params) -> None:
    prompts = spec_prompts()
    serial = LLM(str(small_model_dir), **FLAGS).generate(prompts, params)
    llm = LLM(str(small_model_dir), speculative_method="ngram", speculative_tokens=4, **FLAGS)
    llm.engine.scheduler.proposer = OracleProposer(
        prompts, [o.token_ids for o in serial], 4, lambda i: i % 5 == 3
    )
    same(serial, llm.generate(prompts, params))
    assert llm.stats()["spec_accepted_tokens"] > 0
