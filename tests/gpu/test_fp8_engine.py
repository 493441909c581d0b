"""FP8 and the host n-gram table end to end on a GPU: an FP8 checkpoint's engine (projections and experts
read as FP8 by the kernels) gives the bits of the same checkpoint dequantized on load, with CUDA graphs and
eagerly, batched and alone, greedy and seeded, with n-gram speculation; the n-gram table in pinned host
memory gives the bits of the table on the device."""

import pytest
import torch

from nextserve import LLM, SamplingParams
from nextserve.model.make_model import make_model
from nextserve.ops.fp8 import FP8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# The small preset with experts of 128 rows (whole scale blocks, so they stay FP8) at hidden 256.
OVERRIDES = {"hidden_size": 256, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128}
FLAGS = dict(
    device="cuda", dtype="bfloat16", prefill_chunk=32, page_size=16, kv_capacity=8192, max_context=1024
)
PARAMS = [
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.8, seed=4, ignore_eos=True),
]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return make_model("small", tmp_path_factory.mktemp("fp8"), overrides=OVERRIDES, quantization="fp8")


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(8, 2000, (n,), generator=g).tolist() for n in (9, 70, 140)]


def _run(model_dir, **flags):
    llm = LLM(str(model_dir), max_concurrency=4, **(FLAGS | flags))
    outs = llm.generate(_prompts(), PARAMS)
    s = llm.stats()
    assert (s["kv_pages_free"], s["state_slots_free"]) == (s["kv_pages_total"], s["state_slots_total"])
    return llm, [(o.token_ids, [lp.logprob for lp in o.logprobs or []]) for o in outs]


def test_fp8_engine_equals_its_dequantized_weights(fp8_dir):
    fp8, want = _run(fp8_dir)
    m = fp8.engine.model
    assert m.layers["0"].mlp.experts.gate_up_proj.dtype == FP8
    assert m.layers["3"].self_attn.o_proj.weight.dtype == FP8
    _, none = _run(fp8_dir, quantization="none")
    assert none == want
    _, eager = _run(fp8_dir, cuda_graph=False)
    assert eager == want
    _, sync = _run(fp8_dir, async_scheduling=False)
    assert sync == want
    alone = LLM(str(fp8_dir), max_concurrency=1, **FLAGS)
    for prompt, p, (tokens, lps) in zip(_prompts(), PARAMS, want, strict=True):
        out = alone.generate([prompt], p)[0]
        assert (out.token_ids, [lp.logprob for lp in out.logprobs or []]) == (tokens, lps)


def test_fp8_engine_with_ngram_speculation(fp8_dir):
    _, want = _run(fp8_dir)
    _, spec = _run(fp8_dir, speculative_method="ngram", speculative_tokens=3)
    assert spec == want


def test_quantization_fp8_on_load(tmp_path):
    plain = make_model("small", tmp_path / "plain", overrides=OVERRIDES, dtype=torch.bfloat16)
    fp8 = make_model("small", tmp_path / "fp8", overrides=OVERRIDES, quantization="fp8")
    _, on_load = _run(plain, quantization="fp8")
    _, written = _run(fp8)
    assert on_load == written


def test_ple_table_in_host_memory_gives_the_device_bits(small_model_dir):
    want = None
    for table in ("device", "host"):
        for graph in (True, False):
            llm, outs = _run(small_model_dir, ple_table=table, cuda_graph=graph)
            w = llm.engine.model.layers["1"].ple.ple_embedding.ngram_embedding.weight
            assert w.is_cuda == (table == "device") and (table == "device" or w.is_pinned())
            if want is None:
                want = outs
            assert outs == want, (table, graph)


def test_host_rows_kernel_reads_pinned_memory():
    from nextserve.ops.triton.ple import triton_host_rows

    table = torch.randn(1000, 160, dtype=torch.bfloat16).pin_memory()
    ids = torch.randint(0, 1000, (7, 16), device="cuda")
    got = triton_host_rows(table, ids)
    assert torch.equal(got.cpu(), torch.nn.functional.embedding(ids.cpu(), table))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_host_rows(table, ids)
    ids.copy_(torch.randint(0, 1000, (7, 16), device="cuda"))
    graph.replay()
    assert torch.equal(out.cpu(), torch.nn.functional.embedding(ids.cpu(), table))
