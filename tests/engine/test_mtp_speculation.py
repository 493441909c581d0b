"""MTP speculation (--speculative-method mtp): the MTP block drafts, verify windows check, and a
speculating engine gives the serial reference's tokens, logprobs and top logprobs (C1), greedy and seeded,
float32 and bfloat16, K = 1 and 4, with stops inside a window and on requests resumed from prefix images;
on the trained default model most drafts are accepted; the pool is full again after."""

from pathlib import Path

import pytest
from pool_check import assert_pool_full
from spec_cases import PY_PROMPT, DraftLog, mtp_drafts_resumed_as_cold, py_prompts, same, spec_prompts

from nextserve import LLM, SamplingParams
from nextserve.config import ConfigError
from nextserve.engine_config import DEFAULT_MODEL
from nextserve.model.make_model import make_model
from nextserve.train.evaluate import greedy_with_drafts, load

FLAGS = dict(
    device="cpu", dtype="float32", prefill_chunk=16, page_size=16, kv_capacity=4096, max_concurrency=3
)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=5, ignore_eos=True, logprobs=1)


def pool_full(llm: LLM) -> None:
    assert_pool_full(llm)


@pytest.fixture(autouse=True)
def no_lost_drafts(caplog):
    """A failed MTP run only loses its drafts (outputs stay right), so the output checks cannot see it."""
    yield
    lost = [r for r in caplog.records if r.getMessage() == "MTP drafting failed"]
    assert not lost, lost[0].exc_text


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("dtype,k", [("float32", 1), ("float32", 4), ("bfloat16", 4)])
def test_mtp_speculation_gives_the_serial_outputs(params, dtype, k) -> None:
    """Three concurrent requests on the trained default model (drafts often right, sometimes wrong),
    prompts over several prefill chunks: the serial tokens, logprobs and top logprobs."""
    prompts, flags = py_prompts(), FLAGS | {"dtype": dtype, "prefill_chunk": 32}
    serial = LLM(DEFAULT_MODEL, **flags).generate(prompts, params)
    llm = LLM(DEFAULT_MODEL, speculative_method="mtp", speculative_tokens=k, **flags)
    same(serial, llm.generate(prompts, params))
    pool_full(llm)
    s = llm.stats()
    assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"], s  # both paths of a window ran


def test_mtp_with_prefill_batch_chunks_gives_the_serial_outputs() -> None:
    """--prefill-batch-chunks: the MTP block drafts from each chunk of a forward of several (its rows'
    streams kept per chunk), and the outputs are the serial ones."""
    prompts, flags = py_prompts(), FLAGS | {"prefill_chunk": 16}
    serial = LLM(DEFAULT_MODEL, **flags).generate(prompts, GREEDY)
    llm = LLM(DEFAULT_MODEL, speculative_method="mtp", speculative_tokens=2, prefill_batch_chunks=4, **flags)
    groups, forward_chunks = [], llm.engine.runner.model.forward_chunks
    llm.engine.runner.model.forward_chunks = lambda b: groups.append(len(b)) or forward_chunks(b)
    same(serial, llm.generate(prompts, GREEDY))
    assert groups and max(groups) > 1, groups
    pool_full(llm)
    s = llm.stats()
    assert 0 < s["spec_accepted_tokens"], s


def test_mtp_speculation_on_a_random_model(small_model_dir) -> None:
    """A random checkpoint's MTP (its drafts about always wrong): still the serial outputs."""
    prompts = spec_prompts()
    serial = LLM(str(small_model_dir), **FLAGS).generate(prompts, SEEDED)
    llm = LLM(str(small_model_dir), speculative_method="mtp", speculative_tokens=3, **FLAGS)
    same(serial, llm.generate(prompts, SEEDED))
    pool_full(llm)
    assert llm.stats()["spec_draft_tokens"] > 0


@pytest.mark.parametrize("k", [1, 4])
def test_mtp_on_the_default_model_accepts_most_drafts(k) -> None:
    """The trained MTP: 128 greedy tokens after a Python prompt equal the serial ones, and a real share
    of the drafts is accepted (random drafts from 8192 tokens would give about none). Measured on this
    prompt (float32 CPU): K=1 49 of 79 drafts accepted (0.62), K=4 62 of 263 (62 of 128 tokens came
    from drafts); the bounds leave room for numerics."""
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True, logprobs=1)
    flags = FLAGS | {"prefill_chunk": 64}
    serial = LLM(DEFAULT_MODEL, **flags).generate([PY_PROMPT], params)
    llm = LLM(DEFAULT_MODEL, speculative_method="mtp", speculative_tokens=k, **flags)
    same(serial, llm.generate([PY_PROMPT], params))
    pool_full(llm)
    s = llm.stats()
    if k == 1:
        assert s["spec_accepted_tokens"] > 0.45 * s["spec_draft_tokens"], s
    else:
        assert s["spec_accepted_tokens"] > 40, s


def test_mtp_drafts_are_the_serial_helpers() -> None:
    """The engine's drafts (paged MTP KV trailing the target by one row, chained on the decode path) are
    the MTP's: at each window start they equal the chain train/evaluate.py's serial greedy_with_drafts
    proposes there (one cache, MTP prefill over the whole prompt), up to near-ties of its other
    reduction orders (measured: 63 of 66 windows equal)."""
    llm = LLM(
        DEFAULT_MODEL, speculative_method="mtp", speculative_tokens=4, **(FLAGS | {"prefill_chunk": 64})
    )
    log = DraftLog(llm)
    ids = llm.tokenizer.encode(PY_PROMPT, add_special_tokens=False)
    out = llm.generate([ids], SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True))[0]
    _, model, mtp = load(Path(DEFAULT_MODEL))
    gen, serial_drafts, _ = greedy_with_drafts(model, mtp, ids, 128, 4, chunk=64)
    assert gen[:128] == out.token_ids
    # a window at position p follows the token at p: gen[p - len(ids)], after which drafts[p - len(ids)]
    windows = [(p - len(ids), d) for p, d in log.of(ids) if p - len(ids) < len(serial_drafts)]
    equal = sum(tuple(serial_drafts[i][: len(d)]) == d for i, d in windows)
    assert len(windows) > 40 and equal >= 0.85 * len(windows), (equal, len(windows))


def test_mtp_stops_inside_a_window() -> None:
    """max_tokens and a stop token that fall inside a window (K=4, drafts mostly right on the default
    model) end the request where serial decode does."""
    prompts = [PY_PROMPT, PY_PROMPT[:90]]
    flags = FLAGS | {"prefill_chunk": 64}
    for params in (
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    ):
        serial = LLM(DEFAULT_MODEL, **flags).generate(prompts, params)
        if params.max_tokens == 10:  # stop at each prompt's 6th output token
            stops = [o.token_ids[5] for o in serial]
            params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=stops)
            serial = LLM(DEFAULT_MODEL, **flags).generate(prompts, params)
        llm = LLM(DEFAULT_MODEL, speculative_method="mtp", speculative_tokens=4, **flags)
        same(serial, llm.generate(prompts, params))
        pool_full(llm)
        assert llm.stats()["spec_accepted_tokens"] > 0


def test_mtp_drafts_do_not_depend_on_the_batch(small_model_dir) -> None:
    """The MTP rows run row-invariant (verify windows, chains): a request's drafts alone equal its drafts
    next to two others."""
    prompts, params = spec_prompts(), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = LLM(str(small_model_dir), speculative_method="mtp", speculative_tokens=3, **FLAGS)
    log_alone = DraftLog(alone)
    alone.generate([prompts[1]], params)
    batched = LLM(str(small_model_dir), speculative_method="mtp", speculative_tokens=3, **FLAGS)
    log_batched = DraftLog(batched)
    batched.generate(prompts, params)
    assert log_alone.of(prompts[1]) and log_alone.of(prompts[1]) == log_batched.of(prompts[1])


def test_mtp_with_prefix_reuse(small_model_dir) -> None:
    """Requests resumed from prefix images: the serial outputs, the very drafts a cold engine proposes
    (the images carry the MTP layer's KV and tail), and every page back once the images are dropped."""
    base = spec_prompts()[2]  # 61 tokens: images at 48
    prompts = [base, base[:48] + [7, 8, 9], base + [11, 12], base[:32] + [5] * 32, base[:32] + [5] * 32 + [6]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    # NOTE: the last prompt resumes at 64, the end of the 4th prompt (a whole number of chunks, a page
    # boundary), where the 4th request sampled a token other than its 65th: MTP row 63 is its own.
    cold, warm = mtp_drafts_resumed_as_cold(small_model_dir, FLAGS, prompts, params)
    pool_full(warm)
    pool_full(cold)


def test_mtp_grammar_requests_get_no_drafts(small_model_dir) -> None:
    """A request with a grammar decodes token by token (no drafts) beside speculating ones."""

    class AnyToken:
        def allowed(self, vocab_size):
            return None

        def accept(self, token_id):
            pass

        def is_terminated(self):
            return False

    prompts, params = spec_prompts(), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    serial = LLM(str(small_model_dir), **FLAGS).generate(prompts, params)
    llm = LLM(str(small_model_dir), speculative_method="mtp", speculative_tokens=2, **FLAGS)
    log = DraftLog(llm)
    eng = llm.engine
    rids = [
        eng.add_request(p, params, constraint=AnyToken() if i == 0 else None) for i, p in enumerate(prompts)
    ]
    outs = {}
    while eng.has_unfinished():
        outs |= {o.request_id: o for o in eng.step() if o.finished}
    same(serial, [outs[r] for r in rids])
    assert not log.of(prompts[0]) and log.of(prompts[1])  # the scheduler never asked for its drafts
    pool_full(llm)


@pytest.mark.parametrize(
    "flags,match",
    [({"speculative_method": "medusa"}, "speculative_method"),
     ({"speculative_method": "mtp", "speculative_tokens": 0}, "speculative_tokens"),
     ({"speculative_method": "mtp", "head_embedding": "host"}, "pipeline_stages > 1")],
)  # fmt: skip
def test_bad_mtp_flags(small_model_dir, flags, match) -> None:
    with pytest.raises(ConfigError, match=match):
        LLM(str(small_model_dir), **(FLAGS | flags))


def test_mtp_needs_mtp_weights(tmp_path) -> None:
    """A model directory without mtp.* weights: a clear ConfigError at startup (without MTP it serves)."""
    model_dir = make_model("tiny", tmp_path / "no_mtp", seed=0, with_mtp=False)
    with pytest.raises(ConfigError, match=r"no MTP weights \(mtp\.\*\)"):
        LLM(str(model_dir), speculative_method="mtp", **FLAGS)
    LLM(str(model_dir), speculative_method="ngram", **FLAGS)


def test_mtp_planes_count_in_the_pool_budget(small_model_dir) -> None:
    """The MTP layer's K/V and block-key planes (attention index n_qsa) live in the shared pool, and
    `--kv-capacity auto` counts them in the bytes per token: the pool stays within its budget (less the
    prefix images' state copies, which are taken out of it)."""
    flags = FLAGS | {"kv_capacity": "auto", "cpu_kv_budget_mib": 1}
    llm = LLM(str(small_model_dir), speculative_method="mtp", **flags)
    cfg, pool = llm.engine.model_config, llm.engine.pool
    assert pool.k.shape[0] == len(cfg.qsa_layers) + 1 == pool.block_keys.shape[0]
    page_bytes = sum(t[:, 0].numel() * t.element_size() for t in (pool.k, pool.v, pool.block_keys))
    plan = llm.engine.plan
    budget = 2**20 - plan.prefix_images * plan.slot_bytes
    assert plan.prefix_images == max(1, 2**20 // 8 // plan.slot_bytes)  # at least one image
    assert budget - 2 * page_bytes < pool.num_pages * page_bytes <= budget + page_bytes
