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


def assert_modes_give_the_same_bits(model_dir, want) -> None:
    """A quantized checkpoint's engine (`want`: `run(model_dir)`'s outputs) against the checkpoint
    dequantized on load (whose projections stack otherwise, so its GEMMs differ in order: close, not equal),
    then eagerly, synchronously and one request at a time: the same bits (C1)."""
    _, none = run(model_dir, quantization="none")
    (tokens, lps), (none_tokens, none_lps) = want[0], none[0]
    same = next((i for i, (a, b) in enumerate(zip(tokens, none_tokens, strict=True)) if a != b), len(tokens))
    assert same >= 8, (tokens, none_tokens)
    assert max(abs(a - b) for a, b in zip(lps[:same], none_lps[:same], strict=True)) < 0.1
    _, eager = run(model_dir, cuda_graph=False)
    assert eager == want
    _, sync = run(model_dir, async_scheduling=False)
    assert sync == want
    alone = LLM(str(model_dir), max_concurrency=1, **FLAGS)
    for prompt, p, (tokens, lps) in zip(prompts(), PARAMS, want, strict=True):
        out = alone.generate([prompt], p)[0]
        assert (out.token_ids, [lp.logprob for lp in out.logprobs or []]) == (tokens, lps)
