"""MTP speculation through pipeline stages (runtime/stage_mtp.py; CPU, Gloo): the MTP block on the last
stage drafts the very drafts one process drafts (same streams, tokens and row order), so outputs are
the serial ones (C1) and acceptance is one process's; verify windows run through every stage and
rejected drafts are rewound on every stage; with decode groups, prefix images, pipelined prefill and the
head's embeddings in host memory; and the flags' wrong values are clear errors."""

import pytest
from pool_check import assert_pool_full
from spec_cases import PY_PROMPT, DraftLog, mtp_drafts_resumed_as_cold, py_prompts, same, spec_prompts

from nextserve import LLM, SamplingParams
from nextserve.config import ConfigError
from nextserve.engine_config import DEFAULT_MODEL, EngineConfig
from nextserve.runtime.pipeline import StageNeeds, stage_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # stage processes share 2 cores

FLAGS = dict(
    device="cpu", dtype="float32", prefill_chunk=32, page_size=16, kv_capacity=4096, max_concurrency=3
)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=5, ignore_eos=True, logprobs=1)


@pytest.fixture(autouse=True)
def no_lost_drafts(caplog):
    """Lost drafts change no output, so the output checks cannot see them: the driver logs them."""
    yield
    lost = [r for r in caplog.records if "MTP drafting failed" in r.getMessage()]
    assert not lost, lost[0].getMessage()


def _drafts_equal(one: DraftLog, split: DraftLog, prompts) -> None:
    for p in prompts:
        assert one.of(p) and split.of(p) == one.of(p)


@pytest.mark.parametrize(
    "stages,k,extra",
    [
        (2, 1, {}),
        (2, 4, {}),
        (3, 2, {"pipeline_prefill_chunks": 1}),
        (2, 3, {"head_embedding": "host", "decode_groups": 2}),
    ],
    ids=["2-k1", "2-k4", "3-k2-turns", "2-k3-host-groups"],
)
def test_mtp_through_stages_drafts_what_one_process_drafts(stages: int, k: int, extra: dict) -> None:
    """Three requests on the trained default model (drafts often right, sometimes wrong), prompts of 2 to
    4 prefill chunks, greedy and seeded: the serial outputs, one process's drafts at every window, and
    the pool full again."""
    one = LLM(DEFAULT_MODEL, speculative_method="mtp", speculative_tokens=k, **FLAGS)
    prompts = [one.tokenizer.encode(p, add_special_tokens=False) for p in py_prompts()]
    serial = {id(p): LLM(DEFAULT_MODEL, **FLAGS).generate(prompts, p) for p in (GREEDY, SEEDED)}
    split = LLM(DEFAULT_MODEL, speculative_method="mtp", speculative_tokens=k, pipeline_stages=stages,
                **FLAGS | extra)  # fmt: skip
    try:
        for params in (GREEDY, SEEDED):
            one_log, split_log = DraftLog(one), DraftLog(split)
            same(serial[id(params)], one.generate(prompts, params))
            same(serial[id(params)], split.generate(prompts, params))
            _drafts_equal(one_log, split_log, prompts)
            one.engine.scheduler.proposer = one_log.inner
            split.engine.scheduler.proposer = split_log.inner
        s, o = assert_pool_full(split), one.stats()
        assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"], s
        assert (s["spec_accepted_tokens"], s["spec_draft_tokens"]) == (
            o["spec_accepted_tokens"], o["spec_draft_tokens"]
        )  # fmt: skip
    finally:
        split.close()


def test_mtp_through_stages_with_prefix_reuse(small_model_dir) -> None:
    """Requests resumed from prefix images (the last stage saves and restores the MTP layer's KV pages,
    indexer tail and input streams with its share of the slot): the serial outputs and a cold engine's
    drafts, on a random checkpoint (drafts about always wrong: every window rewinds)."""
    base = spec_prompts()[2]
    prompts = [base, base[:48] + [7, 8, 9], base + [11, 12], base[:32] + [5] * 32]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    flags = FLAGS | {"prefill_chunk": 16}
    _, warm = mtp_drafts_resumed_as_cold(small_model_dir, flags, prompts, params, {"pipeline_stages": 2})
    try:
        assert warm.stats()["spec_draft_tokens"] > 0
        assert_pool_full(warm)
    finally:
        warm.close()


def test_mtp_through_stages_stops_inside_a_window() -> None:
    """max_tokens inside a window (K=4, drafts mostly right): the request ends where serial decode ends."""
    prompts = [PY_PROMPT, PY_PROMPT[:90]]
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    serial = LLM(DEFAULT_MODEL, **FLAGS).generate(prompts, params)
    split = LLM(DEFAULT_MODEL, speculative_method="mtp", speculative_tokens=4, pipeline_stages=2, **FLAGS)
    try:
        same(serial, split.generate(prompts, params))
        assert split.stats()["spec_accepted_tokens"] > 0
        assert_pool_full(split)
    finally:
        split.close()


def test_mtp_through_stages_needs_the_mtp_block(tmp_path) -> None:
    """A checkpoint without mtp.* weights: a ConfigError before any stage process starts."""
    from nextserve.model.make_model import make_model

    d = make_model("tiny", tmp_path / "m", with_mtp=False)
    with pytest.raises(ConfigError, match="no MTP weights"):
        LLM(str(d), speculative_method="mtp", pipeline_stages=2, **FLAGS)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"head_embedding": "gpu"}, "head_embedding must be device or host"),
        ({"head_embedding": "host"}, "needs pipeline_stages > 1"),
        ({"head_embedding": "host", "pipeline_stages": 2}, "speculative_method mtp"),
        ({"head_embedding": "host", "speculative_method": "mtp"}, "needs pipeline_stages > 1"),
    ],
)
def test_head_embedding_bad_values(kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineConfig(model="m", **kw)


def test_the_last_stage_counts_its_mtp_block_and_embeddings(oracle_config) -> None:
    """--kv-capacity auto sizes every stage's pool from what it holds: the last stage's MTP block, and its
    embedding copy unless it is in host memory."""
    import torch

    cfg = oracle_config
    last = stage_layers(cfg.num_hidden_layers, 2)[1]
    plain = StageNeeds(cfg, torch.bfloat16, 4, 0).bytes_and_kv_per_token(last)[0]
    host = StageNeeds(cfg, torch.bfloat16, 4, 0, True, "host").bytes_and_kv_per_token(last)[0]
    device = StageNeeds(cfg, torch.bfloat16, 4, 0, True, "device").bytes_and_kv_per_token(last)[0]
    h, v, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_hidden
    assert host - plain > 2 * (2 * h * h + h + n)  # fc_embedding, fc_hidden, norms, and its decoder layer
    assert device - host == v * h * 2
    first = stage_layers(cfg.num_hidden_layers, 2)[0]
    assert (
        StageNeeds(cfg, torch.bfloat16, 4, 0, True).bytes_and_kv_per_token(first)[0]
        == StageNeeds(cfg, torch.bfloat16, 4, 0).bytes_and_kv_per_token(first)[0]
    )
