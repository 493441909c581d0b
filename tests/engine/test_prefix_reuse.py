"""Prefix reuse (DESIGN.md section 2): a prompt resumes from the longest grid image of its prefix and
gives exactly the tokens and logprobs of a cold run (C1); images never starve admission (C2)."""

import torch
from pool_check import assert_pool_full

from nextserve import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, logprobs=1)
PREFIX = dict(prefix_cache_images=8)


def _ids(n: int, seed: int) -> list[int]:
    ids = torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    ids[7] = ids[8] = 1  # eos inside, for PLE's reset
    return ids


def _same(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]
    assert [lp.top for lp in a.logprobs] == [lp.top for lp in b.logprobs]


def _run(llm, prompt, params, checkpoints=()):
    eng = llm.engine
    rid = eng.add_request(list(prompt), params, checkpoints=checkpoints)
    done = None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                done = out
    return done


def _pool_full_after_clear(llm) -> None:
    llm.engine.clear_prefix_cache()
    assert_pool_full(llm)


def test_agent_turns_resume_exactly(oracle_llm, solo_run) -> None:
    """Turn 2 = turn 1's prompt + its reply + a new message: resumes at turn 1's last boundary."""
    llm = oracle_llm(**PREFIX)
    turn1 = _ids(70, 1)
    out1 = _run(llm, turn1, GREEDY)
    turn2 = turn1 + out1.token_ids + _ids(30, 2)
    # First from turn 1's last boundary (70 -> 64), then, sent again, from turn 2's own (112 -> 96).
    for params, cached in ((GREEDY, 64), (SEEDED, 96)):
        out2 = _run(llm, turn2, params)
        assert out2.cached_tokens == cached
        _same(out2, solo_run(turn2, params))
    _pool_full_after_clear(llm)


def test_repeated_prompt_resumes_below_its_end(oracle_llm, solo_run) -> None:
    llm = oracle_llm(**PREFIX)
    prompt = _ids(64, 3)  # exactly on the grid: the image at 64 cannot give the last token's logits
    _run(llm, prompt, GREEDY)
    again = _run(llm, prompt, GREEDY)
    assert again.cached_tokens == 48
    _same(again, solo_run(prompt, GREEDY))
    _pool_full_after_clear(llm)


def test_message_checkpoint_serves_a_rewritten_last_message(oracle_llm, solo_run) -> None:
    llm = oracle_llm(**PREFIX)
    history, last = _ids(52, 4), _ids(40, 5)
    _run(llm, history + last, GREEDY, checkpoints=(len(history),))
    rewritten = history + _ids(25, 6)
    out = _run(llm, rewritten, GREEDY)
    assert out.cached_tokens == 48  # the boundary at or before where the last message began
    _same(out, solo_run(rewritten, GREEDY))
    _pool_full_after_clear(llm)


def test_anchors_and_images_never_starve_admission(oracle_llm, solo_run) -> None:
    """A pool too small to keep every image: old images give way to new requests; all finish exactly."""
    flags = dict(kv_capacity=160, max_context=128, max_concurrency=2)
    llm = oracle_llm(prefix_cache_images=64, prefix_anchor_chunks=2, **flags)
    evicted, evict = [], llm.engine.prefix.evict_one
    llm.engine.prefix.evict_one = lambda keep=None: evicted.append(evict(keep)) or evicted[-1]
    prompts = [_ids(40 + 9 * i, 10 + i) for i in range(6)]
    outs = llm.generate(prompts, GREEDY)
    for p, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length"
        _same(out, solo_run(p, GREEDY, **flags))
    assert any(evicted), "the pool never ran short: the test does not exercise eviction"
    assert llm.stats()["prefix_images"] > 0
    _pool_full_after_clear(llm)


def test_salted_requests_never_share_images(oracle_llm, solo_run) -> None:
    """cache_salt (a tenant's, or a request's own) keys the images: the same prompt under another salt
    runs cold (cached_tokens 0: nothing is revealed across salts), under its own salt it resumes."""
    llm = oracle_llm(prefix_cache_images=8)  # room for the three salts' images
    prompt = _ids(70, 9)
    runs = []
    for salt in ("tenant-a", "tenant-b", None, "tenant-a", "tenant-b", None):
        rid = llm.engine.add_request(list(prompt), GREEDY, cache_salt=salt)
        done = None
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                if out.request_id == rid and out.finished:
                    done = out
        runs.append(done)
    assert [r.cached_tokens for r in runs] == [0, 0, 0, 64, 64, 64]
    want = solo_run(prompt, GREEDY)
    for r in runs:
        _same(r, want)
    _pool_full_after_clear(llm)


def test_prefix_reuse_is_on_by_default_and_off_with_no_prefix_cache(oracle_llm) -> None:
    on, off = oracle_llm(), oracle_llm(prefix_cache=False)
    assert on.engine.prefix is not None and on.engine.plan.prefix_images >= 1
    assert off.engine.prefix is None and off.engine.plan.prefix_images == 0
    prompt = _ids(70, 10)
    assert [_run(on, prompt, GREEDY).cached_tokens for _ in range(2)] == [0, 64]
    assert [_run(off, prompt, GREEDY).cached_tokens for _ in range(2)] == [0, 0]
