"""What the GPU engine tests of the weight formats and placements share: the small preset with experts of
128 rows at hidden 256 (whole FP8 scale blocks and int4 groups), the engine flags, the requests, and a run
that returns each request's tokens and logprobs with the pool checked full after."""

import torch
from pool_check import assert_pool_full

from nextserve import LLM, SamplingParams

OVERRIDES = {"hidden_size": 256, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128}
FLAGS = dict(
    device="cuda", dtype="bfloat16", prefill_chunk=32, page_size=16, kv_capacity=8192, max_context=1024
)
PARAMS = [
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.8, seed=4, ignore_eos=True),
]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(8, 2000, (n,), generator=g).tolist() for n in (9, 70, 140)]


def run(model_dir, **flags):
    """(the LLM, [(token ids, logprobs)] of `prompts()` under PARAMS) with FLAGS and `flags`."""
    llm = LLM(str(model_dir), max_concurrency=4, **(FLAGS | flags))
    outs = llm.generate(prompts(), PARAMS)
    assert_pool_full(llm)
    return llm, [(o.token_ids, [lp.logprob for lp in o.logprobs or []]) for o in outs]
