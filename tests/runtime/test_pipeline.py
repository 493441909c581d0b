"""Pipeline stages (one process per layer range, Gloo on the CPU) give the single-device outputs bit
for bit (C1): tokens, logprobs and top logprobs, greedy and seeded, with chunked prefill and batched
decode; and the flags that pipelines do not take yet are clear errors."""

import pytest
import torch

from nextserve import LLM, SamplingParams
from nextserve.config import ConfigError
from nextserve.runtime.pipeline import stage_layers

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


@pytest.mark.parametrize("stages,dtype", [(2, "float32"), (3, "float32"), (2, "bfloat16")])
def test_stages_give_the_single_device_outputs(small_model_dir, stages: int, dtype: str) -> None:
    """4 requests over 3 slots (one waits), prompts of 2 to 5 chunks; decode steps batch them."""
    prompts = _prompts()
    one = LLM(str(small_model_dir), dtype=dtype, **FLAGS)
    split = LLM(str(small_model_dir), dtype=dtype, pipeline_stages=stages, **FLAGS)
    try:
        for params in PARAMS:
            _same(one.generate(prompts, params), split.generate(prompts, params))
        s = split.stats()
        assert (s["kv_pages_free"], s["state_slots_free"]) == (s["kv_pages_total"], s["state_slots_total"])
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
        ({"pipeline_stages": 2, "prefix_cache_images": 2, "host_state_slots": 2}, "host image store"),
        ({"pipeline_stages": 2, "speculative_method": "ngram"}, "speculation"),
    ],
)
def test_what_pipelines_do_not_take_yet(small_model_dir, kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        LLM(str(small_model_dir), **FLAGS | kw)


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
        s = split.stats()
        assert (s["kv_pages_free"], s["state_slots_free"]) == (s["kv_pages_total"], s["state_slots_total"])
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
    split = LLM(str(small_model_dir), pipeline_stages=3, prefix_cache_images=images, **FLAGS)
    try:
        got = [split.generate([p], params)[0] for p in prompts]  # one at a time: later ones resume
        _same(want, got)
        assert sum(o.cached_tokens for o in got) > 0
        split.engine.clear_prefix_cache()
        assert {op[0] for op in split.engine.runner.mirror.ops} == {"drop"}  # sent with the next step
        s = split.stats()
        assert (s["kv_pages_free"], s["state_slots_free"]) == (s["kv_pages_total"], s["state_slots_total"])
    finally:
        split.close()
