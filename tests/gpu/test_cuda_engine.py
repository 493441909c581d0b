"""The engine on a CUDA device (run on the GPU machine: pytest -m gpu tests/gpu)."""

import pytest
import torch
from pool_check import assert_pool_full

from nextserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)


def _arena_holds_the_store_alone(llm: LLM) -> None:
    """Every host image is a region of the host arena (no pinned allocation per copy), and the arena
    holds nothing else once no sequence is preempted."""
    arena, prefix = llm.engine.pool.host_arena, llm.engine.prefix
    assert arena is not None
    store = prefix.host if prefix is not None else None  # (a PrefixCache of no images is falsy)
    images = [img for _, img in store._entries.values()] if store is not None else []
    assert all(img.region is not None for img in images)
    assert arena.used == sum(img.region.nbytes for img in images)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(8, 500, (n,), generator=g).tolist() for n in (5, 37, 70, 101, 140)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_equals_alone_on_cuda(tiny_model_dir, dtype: str) -> None:
    """C1 on the GPU backend: tokens and logprobs of a batch equal each request run alone."""
    flags = dict(
        device="cuda", dtype=dtype, prefill_chunk=32, page_size=16, kv_capacity=4096, max_context=1024
    )
    batched = LLM(tiny_model_dir, max_concurrency=8, **flags).generate(_prompts(), GREEDY)
    solo = LLM(tiny_model_dir, max_concurrency=1, **flags)
    for prompt, out in zip(_prompts(), batched, strict=True):
        (alone,) = solo.generate([prompt], GREEDY)
        assert out.token_ids == alone.token_ids
        assert [lp.logprob for lp in out.logprobs] == [lp.logprob for lp in alone.logprobs]
    assert_pool_full(solo)


def test_prefill_batch_chunks_equal_serial_on_cuda(tiny_model_dir) -> None:
    """--prefill-batch-chunks 4 on the GPU (the routed experts of a forward's chunks in one grouped call):
    every request's tokens and logprobs equal the serial engine's, bit for bit."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(8, 500, (n,), generator=g).tolist() for n in (140, 5, 5, 64, 64, 33, 96)]
    flags = dict(device="cuda", dtype="bfloat16", prefill_chunk=32, page_size=16, kv_capacity=8192,
                 max_context=1024)  # fmt: skip
    llm = LLM(tiny_model_dir, max_concurrency=8, prefill_batch_chunks=4, **flags)
    groups, forward_chunks = [], llm.engine.runner.model.forward_chunks
    llm.engine.runner.model.forward_chunks = lambda b: groups.append(len(b)) or forward_chunks(b)
    outs = llm.generate(prompts, GREEDY)
    assert max(groups) == 4, groups
    solo = LLM(tiny_model_dir, max_concurrency=1, async_scheduling=False, **flags)
    for prompt, out in zip(prompts, outs, strict=True):
        (alone,) = solo.generate([prompt], GREEDY)
        assert out.token_ids == alone.token_ids
        assert [lp.logprob for lp in out.logprobs] == [lp.logprob for lp in alone.logprobs]
    assert_pool_full(llm)


def test_cuda_float32_logits_close_to_cpu(tiny_model_dir) -> None:
    flags = dict(dtype="float32", prefill_chunk=32, kv_capacity=2048, max_context=1024, max_concurrency=1)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    prompt = _prompts()[3]
    (cpu,) = LLM(tiny_model_dir, device="cpu", **flags).generate([prompt], params)
    (gpu,) = LLM(tiny_model_dir, device="cuda", **flags).generate([prompt], params)
    assert cpu.token_ids == gpu.token_ids
    for (ti, a), (tj, b) in zip(cpu.logprobs[0].top, gpu.logprobs[0].top, strict=True):
        assert ti == tj and abs(a - b) < 1e-3


@pytest.mark.parametrize("graph", [True, False])
def test_async_scheduling_equals_sync_on_cuda(tiny_model_dir, graph: bool) -> None:
    """Steps launched before the previous one's tokens are read (pending ids resolved on the device, in
    the graphs or eagerly) give the synchronous engine's outputs; requests end by stop token, stop string
    and max_tokens while a step is in flight, and sampled requests force synchronous steps between."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(8, 500, (n,), generator=g).tolist() for n in (3, 17, 40, 64, 90, 120, 9, 33)]
    max_tokens = (5, 60, 1, 33, 48, 2, 60, 17)
    params = [
        SamplingParams(
            max_tokens=m, temperature=0.0, ignore_eos=i % 2 == 0, stop_token_ids=[7, 8, 9] * (i == 3)
        )
        for i, m in enumerate(max_tokens)
    ]
    params[6] = SamplingParams(max_tokens=20, temperature=0.9, seed=3)
    params[7] = SamplingParams(max_tokens=30, temperature=0.0, stop=["a"])
    flags = dict(device="cuda", dtype="bfloat16", prefill_chunk=32, page_size=16, kv_capacity=8192,
                 max_context=1024, max_concurrency=4, cuda_graph=graph)  # fmt: skip
    outs = {}
    for on in (True, False):
        llm = LLM(tiny_model_dir, async_scheduling=on, **flags)
        outs[on] = llm.generate(prompts, params)
        assert (llm.engine.runner._launches > 20) == on
        assert_pool_full(llm)
    for a, b in zip(outs[True], outs[False], strict=True):
        assert a.error is None and (a.token_ids, a.finish_reason, a.text) == (
            b.token_ids,
            b.finish_reason,
            b.text,
        )


@pytest.mark.parametrize("graph", [True, False])
def test_growth_and_preemption_on_cuda_equal_a_roomy_pool(tiny_model_dir, graph: bool) -> None:
    """Pages taken as sequences grow (block tables change under the CUDA graphs) and a preempted request
    copied to host memory and back: the outputs of a pool that never runs short, bit for bit."""
    prompts = _prompts()[1:4]
    params = [SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True, logprobs=2)] * 2
    params.append(SamplingParams(max_tokens=None, temperature=0.9, seed=4, ignore_eos=True, logprobs=2))
    flags = dict(device="cuda", dtype="bfloat16", prefill_chunk=32, page_size=16, max_context=256,
                 max_concurrency=3, cuda_graph=graph)  # fmt: skip
    tight = LLM(tiny_model_dir, kv_capacity=512, **flags)
    roomy = LLM(tiny_model_dir, kv_capacity=768, **flags)
    got, want = tight.generate(prompts, params), roomy.generate(prompts, params)
    assert tight.stats()["preemptions"] >= 1 and roomy.stats()["preemptions"] == 0
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids and len(a.prompt_token_ids) + len(a.token_ids) == 256
        assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]
    _arena_holds_the_store_alone(tight)
    assert_pool_full(tight)


@pytest.mark.parametrize("graph", [True, False])
def test_host_image_store_on_cuda_resumes_exactly(tiny_model_dir, graph: bool) -> None:
    """Images spilled to host memory by the copy stream (pinned, not waited for) and brought back behind
    its event: prompts resumed from them give a cold engine's tokens and logprobs, each request alone,
    right after the spill that moved them (the copy may still run when the next prefill starts)."""
    g = torch.Generator().manual_seed(5)
    bases = [torch.randint(8, 500, (96,), generator=g).tolist() for _ in range(4)]
    flags = dict(device="cuda", dtype="bfloat16", prefill_chunk=32, page_size=16, kv_capacity=4096,
                 max_context=1024, max_concurrency=2, cuda_graph=graph)  # fmt: skip
    store = LLM(tiny_model_dir, prefix_cache_images=1, host_state_slots=8, **flags)
    cold = LLM(tiny_model_dir, prefix_cache=False, **flags)
    for base in bases:  # each one's image pushes the one before it to the host
        store.generate([base], GREEDY)
    assert store.stats()["host_images"] >= 3
    for i, base in enumerate(bases):
        prompt = base + [7 + i] * 9
        (got,) = store.generate([prompt], GREEDY)
        (want,) = cold.generate([prompt], GREEDY)
        assert got.cached_tokens >= 64
        assert got.token_ids == want.token_ids
        assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in want.logprobs]
    assert store.stats()["host_image_hits"] >= 3
    _arena_holds_the_store_alone(store)
    assert_pool_full(store)


def test_a_full_host_arena_reuses_the_regions_of_dropped_images(tiny_model_dir) -> None:
    """A host arena of 1 MiB (a dozen tiny images): spilling images of many sizes drops the least
    recently used ones and carves the new copies out of their regions (once their copies are done), never
    pinning memory of their own; resumes stay exact."""
    g = torch.Generator().manual_seed(6)
    bases = [torch.randint(8, 500, (70 + 9 * i,), generator=g).tolist() for i in range(24)]
    flags = dict(device="cuda", dtype="bfloat16", prefill_chunk=32, page_size=16, kv_capacity=8192,
                 max_context=1024, max_concurrency=2)  # fmt: skip
    store = LLM(tiny_model_dir, prefix_cache_images=1, host_state_slots=64, host_kv_mib=1, **flags)
    cold = LLM(tiny_model_dir, prefix_cache=False, **flags)
    arena, host = store.engine.pool.host_arena, store.engine.prefix.host
    for base in bases:
        store.generate([base], GREEDY)
        _arena_holds_the_store_alone(store)
    assert 1 <= len(host) < len(bases) and arena.nbytes == 2**20
    for base in reversed(bases):  # the most recent first: those still held resume
        prompt = base + [7] * 9
        (got,) = store.generate([prompt], GREEDY)
        (want,) = cold.generate([prompt], GREEDY)
        assert got.token_ids == want.token_ids
        assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in want.logprobs]
    assert store.stats()["host_image_hits"] >= 1
    _arena_holds_the_store_alone(store)
    assert_pool_full(store)
