"""--experts host on a GPU: the routed experts in pinned host memory, read by the same grouped kernels over
the bus, give the bits of the experts on the device (tokens and logprobs, with CUDA graphs and eagerly,
batched), in bf16, FP8 and int4; and they are where the flag says."""

import pytest
import torch

from nextserve import LLM, SamplingParams
from nextserve.model.make_model import make_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

OVERRIDES = {"hidden_size": 256, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128}
FLAGS = dict(
    device="cuda", dtype="bfloat16", prefill_chunk=32, page_size=16, kv_capacity=8192, max_context=1024
)
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)


def _outs(model_dir, **flags):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(8, 2000, (n,), generator=g).tolist() for n in (9, 70, 140)]
    llm = LLM(str(model_dir), max_concurrency=4, **(FLAGS | flags))
    outs = llm.generate(prompts, PARAMS)
    return llm, [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


@pytest.mark.parametrize("quantization", [None, "fp8", "int4"])
@pytest.mark.parametrize("graph", [True, False], ids=["graphs", "eager"])
def test_host_experts_give_the_device_bits(tmp_path, quantization, graph) -> None:
    d = make_model("small", tmp_path / "m", overrides=OVERRIDES, quantization=quantization, group_size=64)
    _, want = _outs(d, cuda_graph=graph)
    llm, got = _outs(d, cuda_graph=graph, experts="host")
    experts = llm.engine.model.layers["0"].mlp.experts.gate_up_proj
    assert not experts.is_cuda and experts.is_pinned()
    assert llm.engine.plan.weights.get(("experts", "host"), 0) > 0
    assert got == want
