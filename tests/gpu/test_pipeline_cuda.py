"""Pipeline stages on GPUs (one process and one GPU per stage; activations GPU to GPU over NCCL, or
through pinned host memory over Gloo) give the single-GPU engine's outputs bit for bit (C1): token ids,
logprobs and top logprobs, greedy and seeded, several concurrent requests, prompts of several prefill
chunks, with and without prefix reuse; and every page and slot comes back (C2).

Run on a machine with 2 or more GPUs: python -m pytest -q -m gpu tests/gpu/test_pipeline_cuda.py
"""

from functools import cache

import pytest
import torch
from pool_check import assert_pool_full

from nextserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

FLAGS = dict(device="cuda", prefill_chunk=16, page_size=16, kv_capacity=4096, max_concurrency=3)
PARAMS = [
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=16, temperature=0.8, top_k=30, seed=3, ignore_eos=True, logprobs=1),
]


def _prompts() -> list[list[int]]:
    """5 requests over 3 slots (two wait), prompts of 1 to 10 chunks of 16."""
    g = torch.Generator().manual_seed(4)
    return [torch.randint(8, 250, (n,), generator=g).tolist() for n in (37, 45, 70, 9, 150)]


@cache
def _single_gpu(model_dir: str, dtype: str) -> tuple:
    """The single-GPU engine's outputs (cuda:0, decode as CUDA graphs) for each of PARAMS."""
    one = LLM(model_dir, dtype=dtype, **FLAGS)
    return tuple(tuple(one.generate(_prompts(), p)) for p in PARAMS)


def _same(want, got) -> None:
    for x, y in zip(want, got, strict=True):
        assert y.finish_reason == x.finish_reason and y.error is None
        assert x.token_ids == y.token_ids
        assert [lp.logprob for lp in x.logprobs] == [lp.logprob for lp in y.logprobs]
        assert [lp.top for lp in x.logprobs] == [lp.top for lp in y.logprobs]


def _pool_full(llm: LLM) -> None:
    assert_pool_full(llm)


@pytest.mark.parametrize("transport", ["host", "shm"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("graph", [True, False], ids=["graphs", "eager"])
def test_two_stages_on_one_gpu_through_host_memory(
    small_model_dir, dtype: str, graph: bool, transport
) -> None:
    """Both stages on cuda:0 (two processes), activations through pinned host memory (over Gloo, or the
    shared-memory rings): the stage code on a GPU (placement, copies, the host transport, each stage's
    decode graphs or eager decode) gives the single-GPU outputs; runs on one GPU."""
    want = _single_gpu(str(small_model_dir), dtype)
    flags = dict(pipeline_stages=2, pipeline_devices="0,0", stage_transport=transport, cuda_graph=graph)
    split = LLM(str(small_model_dir), dtype=dtype, **flags, **FLAGS)
    graphs, replays = split.engine.runner.graphs, []
    assert (graphs is not None) == graph
    if graph:
        replay = graphs.replay
        graphs.replay = lambda *a: replays.append(1) or replay(*a)
    try:
        for params, expected in zip(PARAMS, want, strict=True):
            _same(expected, split.generate(_prompts(), params))
        _pool_full(split)
        assert bool(replays) == graph  # stage 0's decode items replayed its graphs
    finally:
        split.close()


def test_host_image_store_through_stages_on_one_gpu(small_model_dir) -> None:
    """Two stages on cuda:0 with one device image and a host store: images spilled from and brought back
    to every stage's GPU planes give the single-GPU outputs (without prefix reuse), request by request."""
    base = _prompts()[2]
    prompts = [base, base[::-1], base + [11, 12, 13], base[::-1] + [5], base + [11, 12, 13]]
    one = LLM(str(small_model_dir), dtype="bfloat16", **FLAGS)
    want = [one.generate([p], PARAMS[0])[0] for p in prompts]
    flags = dict(pipeline_stages=2, pipeline_devices="0,0", stage_transport="host")
    split = LLM(
        str(small_model_dir), dtype="bfloat16", prefix_cache_images=1, host_state_slots=4, **flags, **FLAGS
    )
    try:
        _same(want, [split.generate([p], PARAMS[0])[0] for p in prompts])
        assert split.stats()["host_image_hits"] >= 1
        split.engine.clear_prefix_cache()
        split.generate([_prompts()[3]], PARAMS[0])
        _pool_full(split)
    finally:
        split.close()


@two_gpus
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("transport", ["nccl", "host"])
def test_gpu_stages_give_the_single_gpu_outputs(small_model_dir, transport: str, dtype: str) -> None:
    want = _single_gpu(str(small_model_dir), dtype)
    split = LLM(str(small_model_dir), dtype=dtype, pipeline_stages=2, stage_transport=transport, **FLAGS)
    try:
        assert split.engine.device == torch.device("cuda", 0)
        assert split.engine.model.layer_range == range(0, 4)  # stage 0 holds only its own layers
        for params, expected in zip(PARAMS, want, strict=True):
            _same(expected, split.generate(_prompts(), params))
        _pool_full(split)
    finally:
        split.close()
    assert split.engine.runner.procs == []
    split.close()  # idempotent


@two_gpus
def test_pipeline_devices_map_stages_to_gpus(small_model_dir) -> None:
    """Stage 0 (the driver) on cuda:1, stage 1 on cuda:0: the same outputs as one GPU."""
    want = _single_gpu(str(small_model_dir), "bfloat16")
    split = LLM(str(small_model_dir), dtype="bfloat16", pipeline_stages=2, pipeline_devices="1,0", **FLAGS)
    try:
        assert split.engine.device == torch.device("cuda", 1)
        assert split.engine.pool.k.device == torch.device("cuda", 1)
        _same(want[0], split.generate(_prompts(), PARAMS[0]))
        _pool_full(split)
    finally:
        split.close()


@two_gpus
@pytest.mark.parametrize("images", [8, 1])
def test_prefix_reuse_through_gpu_stages(small_model_dir, images: int) -> None:
    """Requests resumed from prefix images (each stage restores its own part of the slot state on its
    GPU; shared pages are copied on write in every stage) give the single-GPU outputs; with one image
    kept, images are dropped and replaced as requests come."""
    base = _prompts()[2]
    prompts = [base, base[:48] + [7, 8, 9], base + [11, 12], base[:33], base]
    params = PARAMS[0]
    flags = FLAGS | dict(dtype="bfloat16")
    one = LLM(str(small_model_dir), **flags)
    want = [one.generate([p], params)[0] for p in prompts]
    split = LLM(str(small_model_dir), pipeline_stages=2, prefix_cache_images=images, **flags)
    try:
        got = [split.generate([p], params)[0] for p in prompts]  # one at a time: later ones resume
        _same(want, got)
        assert sum(o.cached_tokens for o in got) > 0
        split.engine.clear_prefix_cache()
        _pool_full(split)
    finally:
        split.close()


def test_decode_groups_and_speculation_on_one_gpu(small_model_dir) -> None:
    """Both stages on cuda:0 through host memory, decode rows as 2 groups circulating through the stages
    and n-gram verify windows (rewound in every stage on a rejected draft): the single-GPU outputs."""
    from spec_cases import OracleProposer

    want = _single_gpu(str(small_model_dir), "bfloat16")
    flags = dict(pipeline_stages=2, pipeline_devices="0,0", stage_transport="host", decode_groups=2)
    split = LLM(str(small_model_dir), dtype="bfloat16", **flags, **FLAGS)
    try:
        _same(want[0], split.generate(_prompts(), PARAMS[0]))
        spec = LLM(str(small_model_dir), dtype="bfloat16", speculative_method="ngram", speculative_tokens=3,
                   **flags, **FLAGS)  # fmt: skip
        try:
            for params, expected in zip(PARAMS, want, strict=True):
                drafts = [o.token_ids for o in expected]
                spec.engine.scheduler.proposer = OracleProposer(_prompts(), drafts, 3, lambda i: i % 4 == 2)
                _same(expected, spec.generate(_prompts(), params))
            assert spec.stats()["spec_draft_tokens"] > 0
            _pool_full(spec)
        finally:
            spec.close()
        _pool_full(split)
    finally:
        split.close()


@pytest.mark.parametrize(
    "head,graph", [("device", True), ("host", True), ("host", False)], ids=["device", "host", "host-eager"]
)
def test_mtp_through_two_stages_on_one_gpu(head: str, graph: bool) -> None:
    """The trained default model's MTP block on the last of two stages on cuda:0 (through host memory),
    its token embeddings a device copy or pinned host memory read over the bus: the plain single-GPU
    outputs, and at every window the drafts the single-GPU MTP engine proposes (the stage's drafter
    graphs or eager windows, bit for bit)."""
    from spec_cases import DraftLog, py_prompts

    from nextserve.engine_config import DEFAULT_MODEL

    flags = FLAGS | {"prefill_chunk": 32, "cuda_graph": graph}
    plain = LLM(DEFAULT_MODEL, dtype="bfloat16", **flags)
    prompts = [plain.tokenizer.encode(p, add_special_tokens=False) for p in py_prompts()]
    one = LLM(DEFAULT_MODEL, dtype="bfloat16", speculative_method="mtp", speculative_tokens=3, **flags)
    split = LLM(DEFAULT_MODEL, dtype="bfloat16", speculative_method="mtp", speculative_tokens=3,
                pipeline_stages=2, pipeline_devices="0,0", stage_transport="host", head_embedding=head,
                **flags)  # fmt: skip
    try:
        for params in PARAMS:
            want = plain.generate(prompts, params)
            one_log, split_log = DraftLog(one), DraftLog(split)
            _same(want, one.generate(prompts, params))
            _same(want, split.generate(prompts, params))
            for p in prompts:
                assert one_log.of(p) and split_log.of(p) == one_log.of(p)
            one.engine.scheduler.proposer = one_log.inner
            split.engine.scheduler.proposer = split_log.inner
        s = split.stats()
        assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"], s
        _pool_full(split)
    finally:
        split.close()


@pytest.mark.parametrize("graph", [True, False], ids=["graphs", "eager"])
def test_pipeline_windows_through_two_stages_on_one_gpu(graph: bool) -> None:
    """--pipeline-windows (K=2) with the trained default model's MTP block on the last of two stages on
    cuda:0 (through host memory): each prompt alone, greedy and seeded, gives the plain single-GPU outputs,
    with guessed windows both held and dropped (a held pair's MTP rows replay the last stage's graphs of up
    to 2K + 2 rows, or run eagerly)."""
    from spec_cases import py_prompts

    from nextserve.engine_config import DEFAULT_MODEL

    flags = FLAGS | {"prefill_chunk": 32, "cuda_graph": graph}
    plain = LLM(DEFAULT_MODEL, dtype="bfloat16", **flags)
    prompts = [plain.tokenizer.encode(p, add_special_tokens=False) for p in py_prompts()]
    split = LLM(DEFAULT_MODEL, dtype="bfloat16", speculative_method="mtp", speculative_tokens=2,
                pipeline_stages=2, pipeline_devices="0,0", stage_transport="host", pipeline_windows=True,
                **flags)  # fmt: skip
    try:
        for params in PARAMS:
            for p in prompts:
                _same(plain.generate([p], params), split.generate([p], params))
        s = split.stats()
        assert s["pipeline_windows_held"] > 0 and s["pipeline_windows_dropped"] > 0, s
        _pool_full(split)
    finally:
        split.close()
