"""--experts host on a GPU: the routed experts in pinned host memory, read by the same grouped kernels over
the bus, give the bits of the experts on the device (tokens and logprobs, with CUDA graphs and eagerly,
batched), in bf16, FP8 and int4; and they are where the flag says."""

import pytest
import torch
from engine_cases import OVERRIDES, run

from nextserve.model.make_model import make_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("quantization", [None, "fp8", "int4"])
@pytest.mark.parametrize("graph", [True, False], ids=["graphs", "eager"])
def test_host_experts_give_the_device_bits(tmp_path, quantization, graph) -> None:
    d = make_model("small", tmp_path / "m", overrides=OVERRIDES, quantization=quantization, group_size=64)
    _, want = run(d, cuda_graph=graph)
    llm, got = run(d, cuda_graph=graph, experts="host")
    experts = llm.engine.model.layers["0"].mlp.experts.gate_up_proj
    assert not experts.is_cuda and experts.is_pinned()
    assert llm.engine.plan.weights.get(("experts", "host"), 0) > 0
    assert got == want
