"""FP8 and the host n-gram table end to end on a GPU: an FP8 checkpoint's engine (projections and experts
read as FP8 by the kernels) gives the same bits with CUDA graphs and eagerly, synchronous and async,
batched and alone, greedy and seeded, with n-gram speculation (C1), and follows the checkpoint dequantized
on load (whose projections stack otherwise, so its GEMMs differ in order: close, not equal); the n-gram
table in pinned host memory gives the bits of the table on the device."""

import pytest
import torch
from engine_cases import FLAGS, OVERRIDES, PARAMS, assert_modes_give_the_same_bits, run

from nextserve import LLM
from nextserve.model.make_model import make_model
from nextserve.ops.fp8 import FP8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return make_model("small", tmp_path_factory.mktemp("fp8"), overrides=OVERRIDES, quantization="fp8")


def test_fp8_engine_modes_give_the_same_bits(fp8_dir):
    fp8, want = run(fp8_dir)
    m = fp8.engine.model
    assert m.layers["0"].mlp.experts.gate_up_proj.dtype == FP8
    assert m.layers["3"].self_attn.o_proj.weight.dtype == FP8
    assert m.layers["0"].linear_attn.in_proj.q.dtype == FP8  # qkv|z|b|a: one padded FP8 stack
    assert_modes_give_the_same_bits(fp8_dir, want)


def test_fp8_engine_with_ngram_speculation(fp8_dir):
    _, want = run(fp8_dir)
    _, spec = run(fp8_dir, speculative_method="ngram", speculative_tokens=3)
    assert spec == want


def test_quantization_fp8_on_load(tmp_path):
    """--quantization fp8 quantizes on the GPU what make-model quantizes on the CPU, bit for bit: the same
    scales and the same E4M3 codes (ops/fp8.quantize divides by a tensor: see its NOTE)."""
    plain = make_model("small", tmp_path / "plain", overrides=OVERRIDES)  # float32 draws, as the FP8 one's
    fp8 = make_model("small", tmp_path / "fp8", overrides=OVERRIDES, quantization="fp8")
    on_load, outs = run(plain, quantization="fp8")
    written, want = run(fp8)
    a = dict(on_load.engine.model.named_parameters())
    for name, p in written.engine.model.named_parameters():
        assert (
            torch.equal(a[name].view(torch.uint8), p.view(torch.uint8))
            if p.dtype == FP8
            else torch.equal(a[name], p)
        )
    assert outs == want


def test_ple_table_in_host_memory_gives_the_device_bits(small_model_dir):
    want = None
    for table in ("device", "host"):
        for graph in (True, False):
            llm, outs = run(small_model_dir, ple_table=table, cuda_graph=graph)
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


def test_pinned_empty_is_exact_size_page_locked_and_read_by_the_kernel():
    """The released table (95.4 GiB) failed to pin through torch's allocator, which rounds to a power of
    two (128 GiB); pinned_empty locks exactly the bytes asked for, and the kernel reads them in place."""
    import gc
    import weakref

    from nextserve.ops.pinned import pinned_empty
    from nextserve.ops.triton.ple import triton_host_rows

    table = pinned_empty((1000, 160), torch.bfloat16)
    assert table.is_pinned() and table.is_contiguous() and table.untyped_storage().nbytes() == 1000 * 160 * 2
    table.copy_(torch.randn(1000, 160, dtype=torch.bfloat16))
    ids = torch.randint(0, 1000, (7, 16), device="cuda")
    assert torch.equal(triton_host_rows(table, ids).cpu(), torch.nn.functional.embedding(ids.cpu(), table))
    # 3 GiB: more than a power-of-two rounding leaves room for on small hosts, and the registration is
    # dropped when the last view goes
    big = pinned_empty((3 * 2**29 + 5, 2), torch.bfloat16)
    big[-1].fill_(1.5)
    assert big.is_pinned() and torch.equal(
        triton_host_rows(big, torch.tensor([[big.shape[0] - 1]], device="cuda")).cpu(), big[-1:].view(1, 1, 2)
    )
    view = big[10:]
    del big
    assert view.is_pinned()
    ref = weakref.ref(view)
    del view
    gc.collect()
    assert ref() is None


def test_fp8_prefill_batch_chunks_equal_serial(fp8_dir):
    """--prefill-batch-chunks with FP8 experts (their grouped call over a forward's chunks, BLOCK_M of one
    chunk): the same bits as the serial engine."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(8, 2000, (n,), generator=g).tolist() for n in (140, 5, 5, 64, 96)]
    llm = LLM(str(fp8_dir), max_concurrency=8, prefill_batch_chunks=4, **FLAGS)
    groups, forward_chunks = [], llm.engine.runner.model.forward_chunks
    llm.engine.runner.model.forward_chunks = lambda b: groups.append(len(b)) or forward_chunks(b)
    outs = llm.generate(prompts, PARAMS[0])
    assert max(groups) == 4, groups
    solo = LLM(str(fp8_dir), max_concurrency=1, async_scheduling=False, **FLAGS)
    for prompt, out in zip(prompts, outs, strict=True):
        (alone,) = solo.generate([prompt], PARAMS[0])
        assert out.token_ids == alone.token_ids
        assert [lp.logprob for lp in out.logprobs] == [lp.logprob for lp in alone.logprobs]
