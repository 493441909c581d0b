"""Speculative decoding never changes an output (C1): verify windows give serial decode's logits bit for
bit, and a speculating engine gives the serial reference's tokens and logprobs whatever its drafts (all
right, all wrong, wrong here and there), greedy or seeded, with stops inside a window."""

import pytest
from pool_check import assert_pool_full
from spec_cases import OracleProposer, check_window_batch, check_window_rows, same, spec_prompts

from nextserve import LLM, SamplingParams
from nextserve.config import ConfigError
from nextserve.engine.speculative import NgramProposer
from nextserve.engine_config import EngineConfig

FLAGS = dict(
    device="cpu", dtype="float32", prefill_chunk=16, page_size=16, kv_capacity=4096, max_concurrency=3
)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=5, ignore_eos=True, logprobs=1)


def test_ngram_proposer() -> None:
    p = NgramProposer(3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3], 10) == [9, 1, 2]  # the 3-gram 1 2 3 recurs
    assert p.propose([5, 6, 7, 5, 6, 8, 5, 6], 10) == [8, 5, 6]  # the most recent occurrence
    assert p.propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]  # at most `limit`
    assert p.propose([1, 2, 3, 4], 10) == []  # nothing recurs
    assert p.propose([4, 4], 10) == []  # too short for a 2-gram to recur
    assert p.propose([4, 4, 4], 10) == [4]
    with pytest.raises(ConfigError):
        NgramProposer(0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_window_rows_equal_serial_decode(small_model_dir, dtype: str) -> None:
    """A window of 6 rows from position 45 (across a page and several indexer blocks) gives each row
    the logits serial decode gives at its position, bit for bit."""
    check_window_rows(small_model_dir, FLAGS | {"dtype": dtype})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_window_batch_rows_and_rewinds_equal_serial_decode(small_model_dir, dtype: str) -> None:
    """Three windows in one forward (5, 3 and 2 rows, the short ones padded): their rows up to the first
    wrong draft equal serial decode's logits, and every slot ends in serial decode's state, rewound or not."""
    check_window_batch(small_model_dir, FLAGS | {"dtype": dtype})


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize(
    "k,wrong",
    [(4, lambda i: False), (3, lambda i: True), (5, lambda i: i % 4 == 2), (1, lambda i: i % 3 == 0)],
    ids=["all-right", "all-wrong", "some-wrong", "k1"],
)
def test_speculation_gives_the_serial_outputs(small_model_dir, params, k, wrong) -> None:
    prompts = spec_prompts()
    serial = LLM(str(small_model_dir), **FLAGS).generate(prompts, params)
    llm = LLM(str(small_model_dir), speculative_method="ngram", speculative_tokens=k, **FLAGS)
    oracle = OracleProposer(prompts, [o.token_ids for o in serial], k, wrong)
    llm.engine.scheduler.proposer = oracle
    same(serial, llm.generate(prompts, params))
    s = assert_pool_full(llm)
    assert s["spec_draft_tokens"] > 0
    if wrong(0) and k == 3:  # every draft wrong: none accepted
        assert s["spec_accepted_tokens"] == 0
    if not wrong(1) and k == 4:  # every draft right: each window commits k + 1 tokens
        assert s["spec_accepted_tokens"] == s["spec_draft_tokens"]


def test_stops_inside_a_window(tiny_model_dir) -> None:
    """max_tokens and a stop token that fall inside a window end the request where serial decode does."""
    prompts = spec_prompts()
    for params in (
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
    ):
        serial = LLM(str(tiny_model_dir), **FLAGS).generate(prompts, params)
        if params.max_tokens == 30:  # stop at each prompt's 5th output token
            stops = [o.token_ids[4] for o in serial]
            params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=stops)
            serial = LLM(str(tiny_model_dir), **FLAGS).generate(prompts, params)
        llm = LLM(str(tiny_model_dir), speculative_method="ngram", speculative_tokens=6, **FLAGS)
        llm.engine.scheduler.proposer = OracleProposer(prompts, [o.token_ids + [9] * 8 for o in serial], 6,
                                                       lambda i: False)  # fmt: skip
        same(serial, llm.generate(prompts, params))


def test_ngram_speculation_on_repetitive_prompts(tiny_model_dir) -> None:
    """The real proposer, on prompts whose continuations recur: the serial outputs."""
    base = list(range(20, 32))
    prompts = [base * 4, base[:5] * 7, spec_prompts()[0]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    serial = LLM(str(tiny_model_dir), **FLAGS).generate(prompts, params)
    llm = LLM(str(tiny_model_dir), speculative_method="ngram", speculative_tokens=4, **FLAGS)
    same(serial, llm.generate(prompts, params))


@pytest.mark.parametrize(
    "kw", [{"speculative_method": "eagle"}, {"speculative_method": None}, {"speculative_tokens": 0},
           {"speculative_tokens": 33}, {"speculative_tokens": "4"}],
)  # fmt: skip
def test_bad_speculative_flags(kw) -> None:
    with pytest.raises(ConfigError, match="speculative"):
        EngineConfig(**kw)


def test_speculation_with_prefix_reuse(small_model_dir) -> None:
    """Requests resumed from prefix images (a shared prefix, resent) speculate as cold ones: the serial
    outputs, and every page back in the pool once the images are dropped."""
    base = spec_prompts()[2]
    prompts = [base, base[:48] + [7, 8, 9], base + [11, 12]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    serial = LLM(str(small_model_dir), **FLAGS).generate(prompts, params)
    llm = LLM(str(small_model_dir), speculative_method="ngram", prefix_cache_images=8, **FLAGS)
    llm.engine.scheduler.proposer = OracleProposer(
        prompts, [o.token_ids for o in serial], 3, lambda i: i % 4 == 1
    )
    for p, want in zip(prompts, serial, strict=True):  # one at a time: later ones resume from images
        same([want], llm.generate([p], params))
    assert sum(o.cached_tokens for o in llm.generate(prompts[1:], params)) > 0
    llm.engine.clear_prefix_cache()
    s = llm.stats()
    assert s["kv_pages_free"] == s["kv_pages_total"] and s["spec_accepted_tokens"] > 0


def test_state_slots_that_do_not_fit_are_a_config_error(oracle_config, monkeypatch) -> None:
    """On a GPU the keep slots of speculation (speculative_tokens per sequence) are counted before they are
    allocated: too many are a ConfigError naming the flags to lower, not an out-of-memory crash."""

    import torch

    from nextserve.cache.states import KindRange, StateSlots
    from nextserve.engine.setup import check_state_memory

    n_attn = len(oracle_config.qsa_layers) + 1
    kinds = KindRange(
        range(len(oracle_config.gdn_layers)), range(len(oracle_config.ple_layers)), range(n_attn)
    )
    per_slot = StateSlots.slot_bytes(oracle_config, kinds, torch.float32)
    config = EngineConfig(model="unused", max_concurrency=8, memory_headroom_mib=0)
    need = per_slot * (1 + 8 * (1 + 4))
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (need, 10 * need))
    check_state_memory(config, oracle_config, cuda, torch.float32, n_attn, 4)  # fits exactly
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (need - 1, 10 * need))
    with pytest.raises(ConfigError, match="lower --max-concurrency or --speculative-tokens"):
        check_state_memory(config, oracle_config, cuda, torch.float32, n_attn, 4)
    # the CPU's budget is --cpu-kv-budget-mib's business
    check_state_memory(config, oracle_config, torch.device("cpu"), torch.float32, n_attn, 4)
