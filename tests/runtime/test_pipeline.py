"""Pipeline stages (one process per layer range, Gloo on the CPU) give the single-device outputs bit
for bit (C1): tokens, logprobs and top logprobs, greedy and seeded, with chunked prefill and batched
decode; and the flags that pipelines do not take (yet) are clear errors. On GPUs:
tests/gpu/test_pipeline_cuda.py."""

import json
import math

import pytest
import torch
from pool_check import assert_pool_full

from nextserve import LLM, SamplingParams
from nextserve.cli import build_parser, engine_config_from_args
from nextserve.config import ConfigError
from nextserve.engine_config import EngineConfig
from nextserve.runtime.pipeline import stage_layers
from nextserve.runtime.stage_transport import NcclTransport
from nextserve.runtime.stage_worker import TRACE_ENV

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # stage processes share 2 cores

FLAGS = dict(device="cpu", prefill_chunk=16, page_size=16, kv_capacity=4096, max_concurrency=3)
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=12, temperature=0.8, top_k=30, seed=3, ignore_eos=True, logprobs=1),
]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(8, 250, (n,), generator=g).tolist() for n in (37, 45, 70, 9)]


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert [lp.logprob for lp in x.logprobs] == [lp.logprob for lp in y.logprobs]
        assert [lp.top for lp in x.logprobs] == [lp.top for lp in y.logprobs]


def test_stage_layers() -> None:
    assert stage_layers(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert stage_layers(5, 1) == [range(0, 5)]
    with pytest.raises(ValueError):
        stage_layers(4, 5)


@pytest.mark.parametrize(
    "stages,dtype,transport",
    [(2, "float32", "auto"), (3, "float32", "auto"), (2, "bfloat16", "host"), (3, "bfloat16", "shm")],
)
def test_stages_give_the_single_device_outputs(small_model_dir, stages: int, dtype: str, transport) -> None:
    """4 requests over 3 slots (one waits), prompts of 2 to 5 chunks; decode steps batch them. (On the
    CPU, `host` is what `auto` picks: the tensors go over Gloo as they are.)"""
    prompts = _prompts()
    one = LLM(str(small_model_dir), dtype=dtype, **FLAGS)
    split = LLM(str(small_model_dir), dtype=dtype, pipeline_stages=stages, stage_transport=transport, **FLAGS)
    try:
        for params in PARAMS:
            _same(one.generate(prompts, params), split.generate(prompts, params))
        assert_pool_full(split)
    finally:
        split.close()
    procs = split.engine.runner.procs
    assert procs == []
    split.close()  # idempotent


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"pipeline_stages": 0}, "pipeline_stages"),
        ({"pipeline_stages": 9}, "exceeds"),
        ({"pipeline_stages": 2, "stage_transport": "nccl"}, "nccl needs CUDA"),
        ({"pipeline_stages": 2, "pipeline_devices": "0,1"}, "CUDA devices"),
    ],
)
def test_what_pipelines_do_not_take_yet(small_model_dir, kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        LLM(str(small_model_dir), **FLAGS | kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="device auto is the CPU only without CUDA")
@pytest.mark.parametrize("kw", [{"stage_transport": "nccl"}, {"pipeline_devices": "0,1"}])
def test_cpu_stages_refuse_gpu_transport_when_auto_picks_the_cpu(small_model_dir, kw) -> None:
    """device auto resolves to the CPU at engine start; the engine refuses what needs CUDA then."""
    with pytest.raises(ConfigError, match="Gloo"):
        LLM(str(small_model_dir), **FLAGS | {"device": "auto", "pipeline_stages": 2} | kw)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"stage_transport": "gloo"}, "stage_transport must be"),
        ({"stage_transport": "NCCL"}, "stage_transport must be"),
        ({"stage_transport": ""}, "stage_transport must be"),
        ({"stage_transport": None}, "stage_transport must be"),
        ({"stage_transport": "nccl", "device": "cpu"}, "nccl needs CUDA"),
        ({"pipeline_prefill_chunks": 0}, "pipeline_prefill_chunks must be"),
        ({"pipeline_prefill_chunks": 65}, "pipeline_prefill_chunks must be"),
        ({"pipeline_prefill_chunks": -2}, "pipeline_prefill_chunks must be"),
        ({"pipeline_prefill_chunks": "many"}, "pipeline_prefill_chunks must be"),
        ({"pipeline_prefill_chunks": True}, "pipeline_prefill_chunks must be"),
        ({"pipeline_prefill_chunks": 2.0}, "pipeline_prefill_chunks must be"),
        ({"pipeline_prefill_chunks": 2, "pipeline_stages": 1}, "needs pipeline_stages > 1"),
        ({"pipeline_devices": ""}, "comma-separated"),
        ({"pipeline_devices": "a,b"}, "comma-separated"),
        ({"pipeline_devices": "0,,1"}, "comma-separated"),
        ({"pipeline_devices": "-1,0"}, "comma-separated"),
        ({"pipeline_devices": "0;1"}, "comma-separated"),
        ({"pipeline_devices": "0.5,1"}, "comma-separated"),
        ({"pipeline_devices": "cuda:0,cuda:1"}, "comma-separated"),
        ({"pipeline_devices": 1}, "comma-separated"),
        ({"pipeline_devices": [0, "1"]}, "comma-separated"),
        ({"pipeline_devices": [True, False]}, "comma-separated"),
        ({"pipeline_devices": "0,0", "stage_transport": "nccl"}, "GPU twice"),
        ({"pipeline_devices": "0"}, "one per stage"),
        ({"pipeline_devices": "0,1,2"}, "one per stage"),
        ({"pipeline_devices": "0,1", "pipeline_stages": 1}, "one per stage"),
        ({"pipeline_devices": "0,1", "device": "cpu"}, "CUDA devices"),
    ],
)
def test_stage_flags_bad_values(kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**{"pipeline_stages": 2, "device": "cuda"} | kw)


def test_stage_flags_good_values(monkeypatch) -> None:
    """pipeline_devices is kept as "i,j" (a list of ints is taken too); stages map to devices by it,
    else consecutively from --device's index; auto transport is nccl on CUDA (shm, else host, where stages
    share a GPU), host on the CPU."""
    c = EngineConfig(device="cuda", pipeline_stages=2, pipeline_devices=" 1, 0 ")
    assert c.pipeline_devices == "1,0"
    assert EngineConfig(device="cuda", pipeline_stages=2, pipeline_devices=[1, 0]) == c
    cpu = EngineConfig(device="cpu", pipeline_stages=3, stage_transport="host")
    assert cpu.stage_devices() == [torch.device("cpu")] * 3 and cpu.stage_transport_kind() == "host"
    assert EngineConfig(device="cpu").stage_transport_kind() == "host"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert c.stage_devices() == [torch.device("cuda", 1), torch.device("cuda", 0)]
    assert c.stage_transport_kind() == "nccl"
    at2 = EngineConfig(device="cuda:2", pipeline_stages=2, stage_transport="host")
    assert at2.stage_devices() == [torch.device("cuda", 2), torch.device("cuda", 3)]
    assert at2.stage_transport_kind() == "host"
    assert EngineConfig(device="cuda", pipeline_stages=2).stage_devices()[1] == torch.device("cuda", 1)
    # stages sharing a GPU: auto takes the shared-memory rings where the machine allows them, else Gloo
    import nextserve.engine_config as engine_config

    def no_room(stages: int) -> None:
        raise ConfigError("no room in /dev/shm")

    shared = EngineConfig(device="cuda", pipeline_stages=3, pipeline_devices="0,1,0")
    monkeypatch.setattr(engine_config, "_check_shm", lambda stages: None)
    assert shared.stage_transport_kind() == "shm"
    monkeypatch.setattr(engine_config, "_check_shm", no_room)
    assert shared.stage_transport_kind() == "host" and c.stage_transport_kind() == "nccl"


def test_stage_flags_on_the_command_line() -> None:
    argv = ["serve", "--pipeline-stages", "2", "--pipeline-devices", "1,0", "--stage-transport", "host"]
    c = engine_config_from_args(build_parser().parse_args(argv))
    assert (c.pipeline_stages, c.pipeline_devices, c.stage_transport) == (2, "1,0", "host")
    assert c.pipeline_prefill_chunks == "auto" and c.prefill_chunks_per_step() == 2
    c = engine_config_from_args(build_parser().parse_args([*argv, "--pipeline-prefill-chunks", "5"]))
    assert c.prefill_chunks_per_step() == 5
    # one process: --pipeline-prefill-chunks 1 is the default, and the step's chunks are
    # --prefill-batch-chunks (auto: 4, in one forward)
    one = EngineConfig(device="cpu", pipeline_prefill_chunks=1)
    assert one.prefill_chunks_per_step() == 4
    assert EngineConfig(device="cpu", prefill_batch_chunks=1).prefill_chunks_per_step() == 1
    argv = ["serve", "--device", "cpu", "--pipeline-stages", "2", "--stage-transport", "nccl"]
    with pytest.raises(ConfigError, match="nccl needs CUDA"):
        engine_config_from_args(build_parser().parse_args(argv))


def _items(trace_dir, rank: int) -> list[dict]:
    path = trace_dir / f"stage-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if '"prefill"' in line]


@pytest.mark.parametrize("chunks", ["auto", 1])
def test_a_prompts_chunks_run_on_two_stages_at_once(small_model_dir, tmp_path, monkeypatch, chunks) -> None:
    """The stages' own trace (TRACE_ENV: when each stage computed each item) of one 160-token prompt in
    chunks of 16: with chunks in flight (auto: one per stage) stage 0 computes a chunk while stage 1
    computes the one before, and the outputs are the single device's; taking turns (1), never."""
    prompt = _prompts()[2] * 3
    assert len(prompt) >= 160
    prompt = prompt[:160]
    params = PARAMS[0]
    want = LLM(str(small_model_dir), **FLAGS).generate([prompt], params)
    monkeypatch.setenv(TRACE_ENV, str(tmp_path))
    split = LLM(str(small_model_dir), pipeline_stages=2, pipeline_prefill_chunks=chunks, **FLAGS)
    try:
        _same(want, split.generate([prompt], params))
    finally:
        split.close()
    first, second = _items(tmp_path, 0), _items(tmp_path, 1)
    assert len(first) == len(second) == 10
    both = sum(max(0.0, min(a["end"], b["end"]) - max(a["start"], b["start"])) for a in first for b in second)
    if chunks == "auto":
        assert both > 0, "no time with both stages computing a prefill chunk"
    else:
        assert both == 0


@pytest.mark.parametrize("world", [2, 3, 4])
def test_nccl_routes_each_direction_on_its_own_group(world: int) -> None:
    """Activations r -> r+1 go on the forward group, logits last -> 0 on the back group (two stages'
    opposite traffic on one NCCL stream could deadlock); no other traffic exists."""
    for rank in range(world):
        t = NcclTransport.__new__(NcclTransport)  # routing only: no NCCL on the CPU
        t.rank, t.world, t.forward, t.back = rank, world, "forward", "back"
        if rank < world - 1:
            assert t._group(rank + 1, sending=True) == "forward"
        if rank > 0:
            assert t._group(rank - 1, sending=False) == "forward"
        if rank == world - 1:
            assert t._group(0, sending=True) == "back"
        if rank == 0:
            assert t._group(world - 1, sending=False) == "back"
        for peer in set(range(world)) - {rank, rank + 1, 0}:
            with pytest.raises(ValueError):
                t._group(peer, sending=True)
        for peer in set(range(world)) - {rank, rank - 1, world - 1}:
            with pytest.raises(ValueError):
                t._group(peer, sending=False)


def test_a_failed_forward_fails_its_request_only(small_model_dir, monkeypatch) -> None:
    """A prefill chunk whose forward raises on stage 0 is passed on marked failed: the other stages stay
    in step, that request ends with an error, the others get the single-device outputs (C2)."""
    prompts = _prompts()
    params = PARAMS[0]
    want = LLM(str(small_model_dir), **FLAGS).generate(prompts, params)
    split = LLM(str(small_model_dir), pipeline_stages=3, **FLAGS)
    try:
        model = split.engine.model
        real = model.forward
        bad = prompts[1][16:32]  # that prompt's second chunk

        def forward(batch, x=None):
            if batch.input_ids.tolist() == bad:
                raise RuntimeError("injected")
            return real(batch, x)

        monkeypatch.setattr(model, "forward", forward)
        got = split.generate(prompts, params)
        assert got[1].finish_reason == "error" and "pipeline stage" in got[1].error
        _same([want[i] for i in (0, 2, 3)], [got[i] for i in (0, 2, 3)])
        assert_pool_full(split)
    finally:
        split.close()


@pytest.mark.parametrize("images", [8, 1])
def test_prefix_reuse_through_stages(small_model_dir, images: int) -> None:
    """Requests resumed from prefix images (every stage restores its own part of the slot state; shared
    pages are copied on write in every stage) give the single-device outputs; with one image kept,
    images are dropped and replaced as requests come."""
    base = _prompts()[2]
    prompts = [base, base[:48] + [7, 8, 9], base + [11, 12], base[:33], base]
    params = PARAMS[0]
    want = LLM(str(small_model_dir), **FLAGS).generate(prompts, params)
    split = LLM(
        str(small_model_dir), pipeline_stages=3, prefix_cache_images=images, host_state_slots=0, **FLAGS
    )
    try:
        got = [split.generate([p], params)[0] for p in prompts]  # one at a time: later ones resume
        _same(want, got)
        assert sum(o.cached_tokens for o in got) > 0
        split.engine.clear_prefix_cache()
        assert {op[0] for op in split.engine.runner.mirror.ops} == {"drop"}  # sent with the next step
        assert_pool_full(split)
    finally:
        split.close()


@pytest.mark.parametrize("stages", [2, 3])
def test_host_image_store_through_stages(small_model_dir, stages: int) -> None:
    """One image on the device and a host store: images go to host memory and come back into fresh pages
    in every stage (each moves its own share of the pages and slot state), and the resumed requests give
    the single-device outputs; nothing is left behind after the cache is cleared."""
    base = _prompts()[2]
    other = base[::-1]
    prompts = [base, other, base + [11, 12, 13], other + [5], base[:50], base + [11, 12, 13]]
    want = [LLM(str(small_model_dir), **FLAGS).generate([p], PARAMS[i % 2])[0] for i, p in enumerate(prompts)]
    split = LLM(
        str(small_model_dir), pipeline_stages=stages, prefix_cache_images=1, host_state_slots=4, **FLAGS
    )
    try:
        got = [split.generate([p], PARAMS[i % 2])[0] for i, p in enumerate(prompts)]
        _same(want, got)
        s = split.stats()
        assert s["host_image_hits"] >= 2 and s["host_images"] >= 1
        assert sum(o.cached_tokens for o in got) > 0
        workers = split.engine.runner
        split.engine.clear_prefix_cache()
        assert {op[0] for op in workers.mirror.ops} <= {"drop", "host_drop"}
        split.generate([_prompts()[3]], PARAMS[0])  # a step carries the drops to the stages
        assert assert_pool_full(split)["host_images"] == 0
    finally:
        split.close()


@pytest.mark.parametrize(
    "stages,k,wrong,images",
    [
        (2, 4, lambda i: False, 0),
        (2, 3, lambda i: i % 4 == 2, 0),
        (3, 5, lambda i: i % 3 == 0, 0),
        (2, 3, lambda i: True, 0),
        (3, 3, lambda i: i % 4 == 1, 4),
    ],
    ids=["2-all-right", "2-some-wrong", "3-some-wrong", "2-all-wrong", "3-images"],
)
def test_speculation_through_stages(small_model_dir, stages: int, k: int, wrong, images: int) -> None:
    """n-gram speculation with stages: verify windows run through every stage, rejected drafts are rewound
    in every stage (each restores its share of the slot state and runs the committed rows again); the
    outputs equal one process's serial decode, greedy and seeded, and the pool is full again. With
    images kept, the second pass over the prompts resumes from the first pass's prefix images."""
    from spec_cases import OracleProposer

    prompts = _prompts()
    one = LLM(str(small_model_dir), dtype="float32", **FLAGS)
    split = LLM(str(small_model_dir), dtype="float32", pipeline_stages=stages, speculative_method="ngram",
                speculative_tokens=k, prefix_cache_images=images, **FLAGS)  # fmt: skip
    try:
        for params in PARAMS:
            serial = one.generate(prompts, params)
            split.engine.scheduler.proposer = OracleProposer(prompts, [o.token_ids for o in serial], k, wrong)
            _same(serial, split.generate(prompts, params))
        if images:  # resumed once more, with the seeded run's drafts (mostly wrong for greedy)
            got = split.generate(prompts, PARAMS[0])
            _same(one.generate(prompts, PARAMS[0]), got)
            assert sum(o.cached_tokens for o in got) > 0
            split.engine.clear_prefix_cache()
        s = assert_pool_full(split)
        assert s["spec_draft_tokens"] > 0
        assert (s["spec_accepted_tokens"] == 0) == (wrong(0) and wrong(1))
    finally:
        split.close()


@pytest.mark.parametrize("stages,groups", [(2, 2), (3, 3), (2, 3)])
def test_decode_groups_give_the_single_device_outputs(small_model_dir, stages: int, groups: int) -> None:
    """Decode rows as round-robin groups circulating through the stages, several tokens a step: the
    single process's tokens, logprobs and top logprobs (greedy, seeded, a stop token, max_tokens below
    the rounds), 5 requests over 3 slots, the pool full again after."""
    prompts = _prompts() + [_prompts()[0][:20]]
    one = LLM(str(small_model_dir), dtype="float32", **FLAGS)
    split = LLM(str(small_model_dir), dtype="float32", pipeline_stages=stages, decode_groups=groups, **FLAGS)
    try:
        want = one.generate(prompts, PARAMS[0])
        stop = SamplingParams(
            max_tokens=12, temperature=0.0, logprobs=1, stop_token_ids=[want[1].token_ids[4]]
        )
        for params in [*PARAMS, stop, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)]:
            got = split.generate(prompts, params)
            ref = one.generate(prompts, params)
            assert [o.finish_reason for o in got] == [o.finish_reason for o in ref]
            if params.logprobs is None:
                assert [o.token_ids for o in got] == [o.token_ids for o in ref]
            else:
                _same(ref, got)
        assert len(split.generate(prompts, stop)[1].token_ids) == 5  # stopped inside a step's rounds
        assert_pool_full(split)
    finally:
        split.close()


def test_decode_groups_with_speculation(small_model_dir) -> None:
    """Verify windows and decode groups in the same steps (requests with and without drafts)."""
    from spec_cases import OracleProposer

    prompts = _prompts()
    one = LLM(str(small_model_dir), dtype="float32", **FLAGS)
    serial = one.generate(prompts, PARAMS[1])
    split = LLM(str(small_model_dir), dtype="float32", pipeline_stages=2, decode_groups=2,
                speculative_method="ngram", speculative_tokens=3, **FLAGS)  # fmt: skip
    try:
        oracle = OracleProposer(prompts, [o.token_ids for o in serial], 3, lambda i: i % 4 == 2)
        inner = oracle.drafts
        oracle.drafts = lambda seq, limit: inner(seq, limit) if seq.prompt_ids != prompts[1] else []
        split.engine.scheduler.proposer = oracle
        _same(serial, split.generate(prompts, PARAMS[1]))
        assert split.stats()["spec_draft_tokens"] > 0
    finally:
        split.close()


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"decode_groups": 0}, "positive integer"),
        ({"decode_groups": -2}, "positive integer"),
        ({"decode_groups": "2"}, "positive integer"),
        ({"decode_groups": 2.0}, "positive integer"),
        ({"decode_groups": 65}, "at most 64"),
        ({"decode_groups": 2, "pipeline_stages": 1}, "needs pipeline_stages"),
    ],
)
def test_decode_groups_bad_values(kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**{"pipeline_stages": 2, "device": "cpu"} | kw)


def test_auto_kv_capacity_counts_every_stages_weights_and_slots(oracle_config, monkeypatch) -> None:
    """With stages on GPUs, --kv-capacity auto is sized before any stage loads its weights: from stage 0's
    free memory less each GPU's stages' weights and state slots, per token of the KV planes they hold."""
    import math

    from nextserve.cache.kv_pool import kv_bytes_per_token
    from nextserve.cache.states import KindRange, StateSlots
    from nextserve.model.shapes import expected_shapes
    from nextserve.runtime.pipeline import StageNeeds
    from nextserve.runtime.pipeline import in_stage as _in_stage

    cfg, dtype = oracle_config, torch.bfloat16
    ranges = stage_layers(cfg.num_hidden_layers, 2)
    shapes = expected_shapes(cfg)
    owners = {name: [r for r in ranges if _in_stage(name, r, cfg)] for name in shapes}
    assert all(len(o) == 1 for o in owners.values())  # every tensor is loaded by exactly one stage
    needs = StageNeeds(cfg, dtype, num_slots=2, window_steps=3)  # --max-concurrency 2, 3 keep slots

    def need(r: range) -> tuple[int, int]:
        weights = sum(math.prod(s) for n, s in shapes.items() if _in_stage(n, r, cfg)) * 2
        kinds = KindRange.of(cfg, r)
        slots = StateSlots.slot_bytes(cfg, kinds, dtype) * (1 + 2 * (1 + 3))
        return weights + slots, kv_bytes_per_token(cfg, len(kinds.attn), dtype)

    free = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 2 * free))
    (n0, t0), (n1, t1) = need(ranges[0]), need(ranges[1])
    budget = free - 2**20
    two_gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    got = needs.kv_tokens(ranges, two_gpus, 2**20)  # --memory-headroom-mib 1
    assert got == min((budget - n0) // t0, (budget - n1) // t1)
    one_gpu = [torch.device("cuda", 0)] * 2  # both stages share one GPU: their needs add up
    assert needs.kv_tokens(ranges, one_gpu, 2**20) == (budget - n0 - n1) // (t0 + t1)


@pytest.mark.parametrize("groups", [1, 2])
def test_preemption_through_the_stages_gives_the_single_device_outputs(small_model_dir, groups: int) -> None:
    """A pool of two contexts, three requests without max_tokens: the one that arrived last moves to host
    memory on every stage (each its own layers' pages and state) and comes back bit for bit."""
    prompts = _prompts()[:3]
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True, logprobs=1)
    flags = FLAGS | dict(kv_capacity=144, max_context=80, prefix_cache_images=0)
    one = LLM(str(small_model_dir), dtype="float32", **(flags | {"kv_capacity": 240}))
    split = LLM(str(small_model_dir), dtype="float32", pipeline_stages=2, decode_groups=groups, **flags)
    try:
        want, got = one.generate(prompts, params), split.generate(prompts, params)
        assert split.stats()["preemptions"] >= 1 and one.stats()["preemptions"] == 0
        _same(want, got)
        assert_pool_full(split)
    finally:
        split.close()


@pytest.mark.parametrize(
    "stages,victim,transport", [(2, 0, "auto"), (3, 0, "auto"), (3, 1, "auto"), (3, 1, "shm")]
)
def test_a_dead_stage_fails_its_requests_and_never_hangs(
    small_model_dir, stages: int, victim: int, transport: str
) -> None:
    """`kill -9` of a stage process mid-request: the request ends with an error naming the stage within
    seconds, later requests are refused at once (no step loops on a broken pipeline), and close() leaves
    no stage process behind."""
    import threading
    import time

    llm = LLM(str(small_model_dir), pipeline_stages=stages, stage_transport=transport, **FLAGS)
    procs = list(llm.engine.runner.procs)
    try:
        timer = threading.Timer(0.5, procs[victim].kill)
        timer.start()
        t0 = time.monotonic()
        params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
        (out,) = llm.generate([_prompts()[0]], params)
        assert time.monotonic() - t0 < 30
        assert out.finish_reason == "error" and "pipeline stage" in out.error, out.error
        assert llm.engine.failure() is not None and "exited" in llm.engine.failure()
        with pytest.raises(RuntimeError, match="cannot serve"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    finally:
        t0 = time.monotonic()
        llm.close()
        assert time.monotonic() - t0 < 10
    assert all(p.poll() is not None for p in procs)


@pytest.mark.parametrize("counts", ["1,7", "5,2,1", "2,2,1,1,2"])
def test_uneven_stage_layers_give_the_single_device_outputs(small_model_dir, counts: str) -> None:
    """--stage-layers: 2 to 5 stages of unequal layer counts (the last stage keeps the head)."""
    prompts = _prompts()[:2]
    one = LLM(str(small_model_dir), dtype="float32", **FLAGS)
    stages = len(counts.split(","))
    split = LLM(str(small_model_dir), dtype="float32", pipeline_stages=stages, stage_layers=counts, **FLAGS)
    try:
        assert len(split.engine.runner.model.layers) == int(counts.split(",")[0])  # stage 0's own layers
        _same(one.generate(prompts, PARAMS[0]), split.generate(prompts, PARAMS[0]))
        assert_pool_full(split)
    finally:
        split.close()


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"pipeline_stages": 2, "stage_layers": "4,3"}, "sums to 7 layers, the model has 8"),
        ({"pipeline_stages": 2, "stage_layers": "8,0"}, "no layers"),
        ({"pipeline_stages": 3, "stage_layers": "4,4"}, "names 2 stages"),
        ({"pipeline_stages": 2, "stage_layers": "4;4"}, "comma-separated"),
        ({"pipeline_stages": 2, "stage_layers": "-1,9"}, "comma-separated"),
        ({"pipeline_stages": 9, "stage_layers": "1,1,1,1,1,1,1,1,1"}, "exceeds"),
    ],
)
def test_bad_stage_layers_are_config_errors(small_model_dir, kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        LLM(str(small_model_dir), dtype="float32", **(FLAGS | kw))


def test_stage_layers_as_a_list_and_from_the_cli() -> None:
    assert EngineConfig(pipeline_stages=3, stage_layers=[2, 3, 3]).stage_layer_counts() == [2, 3, 3]
    args = build_parser().parse_args(["serve", "--pipeline-stages", "2", "--stage-layers", "3, 5"])
    assert engine_config_from_args(args).stage_layers == "3,5"
    assert stage_layers(8, 2, [3, 5]) == [range(0, 3), range(3, 8)]
    with pytest.raises(ValueError):
        stage_layers(8, 2, [3, 4])


def test_stage_memory_caps_and_auto_layers() -> None:
    c = EngineConfig(device="cuda", pipeline_stages=5, stage_memory_gib="24,12,12,12,12", stage_layers="auto")
    assert c.stage_memory_caps() == [24.0, 12.0, 12.0, 12.0, 12.0]
    assert c.stage_layer_counts(48) == [16, 8, 8, 8, 8]  # layout A's cards, in proportion
    b = EngineConfig(device="cuda", pipeline_stages=4, stage_memory_gib=[12, 12, 24, 24], stage_layers="auto")
    assert b.stage_layer_counts(48) == [8, 8, 16, 16] and sum(b.stage_layer_counts(7)) == 7
    tiny = EngineConfig(device="cuda", pipeline_stages=3, stage_memory_gib="100,1,1", stage_layers="auto")
    assert tiny.stage_layer_counts(4) == [2, 1, 1]  # every stage keeps at least one layer
    with pytest.raises(ConfigError, match="3 stages for 2 layers"):
        tiny.stage_layer_counts(2)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"stage_memory_gib": "24,0"}, "positive GiB"),
        ({"stage_memory_gib": "24,x"}, "positive GiB"),
        ({"stage_memory_gib": "24"}, "one cap per stage"),
        ({"stage_memory_gib": "24,12", "device": "cpu"}, "CPU backend"),
        ({"stage_layers": "auto"}, "stage_memory_gib"),
    ],
)
def test_bad_stage_memory_flags(kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**({"device": "cuda", "pipeline_stages": 2} | kw))


def test_a_stage_past_its_cap_names_itself(monkeypatch, small_model_dir) -> None:
    """KV sizing with --stage-memory-gib: the tightest stage sets the pool; one whose layers alone pass its
    cap is a ConfigError naming it and the flags."""
    from nextserve.config import ModelConfig
    from nextserve.runtime.pipeline import StageNeeds

    cfg = ModelConfig.from_dir(small_model_dir)
    need = StageNeeds(cfg, torch.bfloat16, 4, 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (80 * 2**30, 80 * 2**30))
    ranges, devices = stage_layers(8, 2), [torch.device("cuda", 0)] * 2
    roomy = need.kv_tokens(ranges, devices, 2**20)
    capped = need.kv_tokens(ranges, devices, 2**20, [1.0, 0.01])
    _, per_token = need.bytes_and_kv_per_token(ranges[1])
    assert capped < roomy and capped <= int(0.01 * 2**30) // per_token
    with pytest.raises(ConfigError, match="pipeline stage 1 \\(layers 4-7\\).*--stage-layers"):
        need.kv_tokens(ranges, devices, 2**20, [1.0, 0.0001])


def test_stage_needs_count_int4_weights_as_held(tmp_path) -> None:
    """A stage's needs (for its cap and the KV sizing) count int4 weights as words and scales."""
    from nextserve.config import ModelConfig
    from nextserve.engine.memory_plan import held_tensor_bytes
    from nextserve.model.make_model import make_model
    from nextserve.model.shapes import expected_shapes
    from nextserve.runtime.pipeline import StageNeeds

    d = make_model("tiny", tmp_path / "q", seed=1, quantization="int4", group_size=16)
    cfg = ModelConfig.from_dir(d)
    config = EngineConfig(model=str(d), device="cpu", dtype="bfloat16")
    held = held_tensor_bytes(config, cfg, torch.device("cpu"), torch.bfloat16, False)
    layers = range(0, cfg.num_hidden_layers)
    plain, _ = StageNeeds(cfg, torch.bfloat16, 2, 0).bytes_and_kv_per_token(layers)
    packed, _ = StageNeeds(cfg, torch.bfloat16, 2, 0, held=held).bytes_and_kv_per_token(layers)
    experts = [n for n in held if ".mlp.experts." in n]
    saved = sum(math.prod(s) * 2 for n, s in expected_shapes(cfg).items() if n in experts) - sum(
        held[n] for n in experts
    )
    assert saved > 0 and plain - packed >= saved
