"""C1 in int4: the trained default model quantized on load (`--quantization int4`, held as int4 words) gives
its serial reference's tokens and logprobs in every speed mode: batched decode, MTP and n-gram speculation,
prefix reuse, and two pipeline stages; the pool is full again after each."""

from __future__ import annotations

import pytest
import torch
from pool_check import assert_pool_full
from spec_cases import MODE_FLAGS, MODE_PARAMS, same, serial_reference

from nextserve import LLM
from nextserve.engine_config import DEFAULT_MODEL

FLAGS = MODE_FLAGS | dict(quantization="int4")
PARAMS = MODE_PARAMS


@pytest.fixture(scope="module")
def serial():
    llm, prompts, outputs = serial_reference(FLAGS, PARAMS)
    experts = llm.engine.model.layers["0"].mlp.experts
    assert experts.gate_up_proj.dtype == torch.int32  # held as int4 words
    return prompts, outputs


@pytest.mark.parametrize(
    "flags",
    [
        dict(max_concurrency=3),
        dict(max_concurrency=3, speculative_method="mtp", speculative_tokens=3),
        dict(max_concurrency=3, speculative_method="ngram", speculative_tokens=3),
        dict(max_concurrency=3, pipeline_stages=2),
    ],
    ids=["batched", "mtp", "ngram", "two stages"],
)
def test_int4_speed_modes_give_the_serial_outputs(serial, flags, one_torch_thread) -> None:
    prompts, want = serial
    llm = LLM(DEFAULT_MODEL, **(FLAGS | flags))
    for i, p in enumerate(PARAMS):
        same(want[i], llm.generate(prompts, p))
    # a second pass resumes from the prefix images the first one left
    same(want[0], llm.generate(prompts, PARAMS[0]))
    assert_pool_full(llm)
    if flags.get("speculative_method") == "mtp":
        s = llm.stats()
        assert 0 < s["spec_accepted_tokens"] <= s["spec_draft_tokens"], s
