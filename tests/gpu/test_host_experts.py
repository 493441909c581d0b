"""--experts host on a GPU: the routed experts in pinned host memory, read by the same grouped kernels over
the bus, give the bits of the experts on the device (tokens and logprobs, with CUDA graphs and eagerly,
batched), in bf16, FP8 and int4, without a device expert cache and with one of one expert a layer or of all;
and they are where the flags say."""

import pytest
import torch
from engine_cases import OVERRIDES, run

from nextserve.model.make_model import make_model
from nextserve.ops.cached_experts import expert_bytes
from nextserve.runtime.expert_cache import moe_owners

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("quantization", [None, "fp8", "int4"])
@pytest.mark.parametrize("graph", [True, False], ids=["graphs", "eager"])
def test_host_experts_give_the_device_bits(tmp_path, quantization, graph) -> None:
    d = make_model("small", tmp_path / "m", overrides=OVERRIDES, quantization=quantization, group_size=64)
    _, want = run(d, cuda_graph=graph)
    llm, got = run(d, cuda_graph=graph, experts="host", expert_cache_gib=0)
    experts = llm.engine.model.layers["0"].mlp.experts.gate_up_proj
    assert not experts.is_cuda and experts.is_pinned()
    assert llm.engine.plan.weights.get(("experts", "host"), 0) > 0
    assert got == want


@pytest.mark.parametrize("quantization", [None, "int4"])
@pytest.mark.parametrize("slots", [1, 1000], ids=["one a layer", "all"])
def test_a_device_expert_cache_gives_the_device_bits(tmp_path, quantization, slots) -> None:
    d = make_model("small", tmp_path / "m", overrides=OVERRIDES, quantization=quantization, group_size=64)
    _, want = run(d)
    bare, _ = run(d, experts="host", expert_cache_gib=0)
    owners = moe_owners(bare.engine.model)
    per_slot = len(owners) * (expert_bytes(owners[0].gate_up) + expert_bytes(owners[0].down))
    E = owners[0].gate_up.shape[0]
    del bare
    llm, got = run(d, experts="host", expert_cache_gib=min(slots, E) * per_slot * 1.01 / 2**30)
    assert llm.engine.expert_cache.slots == min(slots, E)
    assert got == want
    s = llm.stats()
    assert s["expert_cache_fills"] > 0 and s["expert_cache_hits"] > 0, s
