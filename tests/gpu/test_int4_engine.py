"""W4A16 end to end on a GPU: an int4 checkpoint's engine (projections and experts read as int4 words by the
kernels, ops/triton/int4_tiles.py) gives the same bits with CUDA graphs and eagerly, synchronous and async,
batched and alone, greedy and seeded, with MTP and n-gram speculation (C1), and follows the checkpoint
dequantized on load (`--quantization none`: close, not equal, as for FP8)."""

import pytest
import torch
from engine_cases import FLAGS, OVERRIDES, PARAMS, prompts, run

from nextserve import LLM
from nextserve.model.make_model import make_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory):
    return make_model(
        "small", tmp_path_factory.mktemp("int4"), overrides=OVERRIDES, quantization="int4", group_size=64,
        dtype=torch.bfloat16,
    )  # fmt: skip


def test_int4_engine_modes_give_the_same_bits(int4_dir):
    llm, want = run(int4_dir)
    m = llm.engine.model
    assert m.layers["0"].mlp.experts.gate_up_proj.dtype == torch.int32
    assert m.layers["3"].self_attn.o_proj.weight.dtype == torch.int32
    _, none = run(int4_dir, quantization="none")
    (tokens, lps), (none_tokens, none_lps) = want[0], none[0]
    same = next((i for i, (a, b) in enumerate(zip(tokens, none_tokens, strict=True)) if a != b), len(tokens))
    assert same >= 8, (tokens, none_tokens)
    assert max(abs(a - b) for a, b in zip(lps[:same], none_lps[:same], strict=True)) < 0.1
    _, eager = run(int4_dir, cuda_graph=False)
    assert eager == want
    _, sync = run(int4_dir, async_scheduling=False)
    assert sync == want
    alone = LLM(str(int4_dir), max_concurrency=1, **FLAGS)
    for prompt, p, (tokens, lps) in zip(prompts(), PARAMS, want, strict=True):
        out = alone.generate([prompt], p)[0]
        assert (out.token_ids, [lp.logprob for lp in out.logprobs or []]) == (tokens, lps)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_int4_engine_with_speculation(int4_dir, method):
    _, want = run(int4_dir)
    _, spec = run(int4_dir, speculative_method=method, speculative_tokens=3)
    assert spec == want
