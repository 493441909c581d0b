"""The 8-bit KV cache end to end on a GPU (`--kv-dtype int8`, `fp8`): the QSA kernels read the 8-bit codes
and scales (ops/triton/kv8.py), prompt chunks' writes quantize in PyTorch and decode rows' in the paged-write
kernel (inside the decode CUDA graphs), with the same bits. With 8-bit KV the engine gives the same bits
with CUDA graphs and eagerly, synchronous and async, batched and alone (and with int8, with MTP and n-gram
speculation: C1 among modes of one KV dtype), and stays close to 16-bit KV."""

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
def model_dir(tmp_path_factory):
    return make_model("small", tmp_path_factory.mktemp("kv8"), overrides=OVERRIDES, dtype=torch.bfloat16)


@pytest.mark.parametrize("form", ["int8", "fp8"])
def test_8_bit_kv_engine_modes_give_the_same_bits(model_dir, form):
    llm, want = run(model_dir, kv_dtype=form)
    assert llm.engine.pool.k.dtype == torch.int8 and llm.engine.pool.kv_dtype == form
    _, wide = run(model_dir)
    (tokens, lps), (wide_tokens, wide_lps) = want[0], wide[0]
    same = next((i for i, (a, b) in enumerate(zip(tokens, wide_tokens, strict=True)) if a != b), len(tokens))
    assert same >= 8 and max(abs(a - b) for a, b in zip(lps[:same], wide_lps[:same], strict=True)) < 0.1
    assert want != wide  # the 8-bit planes are read
    for flags in (dict(cuda_graph=False), dict(async_scheduling=False)):
        assert run(model_dir, kv_dtype=form, **flags)[1] == want, flags
    alone = LLM(str(model_dir), max_concurrency=1, kv_dtype=form, **FLAGS)
    for prompt, p, (tokens, lps) in zip(prompts(), PARAMS, want, strict=True):
        out = alone.generate([prompt], p)[0]
        assert (out.token_ids, [lp.logprob for lp in out.logprobs or []]) == (tokens, lps)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_int8_kv_engine_with_speculation(model_dir, method):
    _, want = run(model_dir, kv_dtype="int8")
    assert run(model_dir, kv_dtype="int8", speculative_method=method, speculative_tokens=3)[1] == want
