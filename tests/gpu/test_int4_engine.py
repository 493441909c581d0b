"""W4A16 end to end on a GPU: an int4 checkpoint's engine (projections and experts read as int4 words by the
kernels, ops/triton/int4_tiles.py) gives the same bits with CUDA graphs and eagerly, synchronous and async,
batched and alone, greedy and seeded, with MTP and n-gram speculation (C1), and follows the checkpoint
dequantized on load (`--quantization none`: close, not equal, as for FP8)."""

import pytest
import torch
from engine_cases import OVERRIDES, assert_modes_give_the_same_bits, run

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
    assert_modes_give_the_same_bits(int4_dir, want)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_int4_engine_with_speculation(int4_dir, method):
    _, want = run(int4_dir)
    _, spec = run(int4_dir, speculative_method=method, speculative_tokens=3)
    assert spec == want
