"""The scheduler under the slot and page limits (issue 3, C2): admission waits for pages, the
capacity finish, the bounded queue, prompt-length checks, aborts that free everything at once."""

from __future__ import annotations

import random

import pytest

from nextserve import SamplingParams
from nextserve.engine.scheduler import QueueFull

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 256) for _ in range(n)]


def full(llm) -> bool:
    s = llm.stats()
    return (
        s["kv_pages_free"] + s["kv_pages_in_images"] == s["kv_pages_total"]
        and s["state_slots_free"] == s["state_slots_total"]
        and s["waiting"] == 0
        and s["running"] == 0
    )


def drive(engine, max_steps: int = 2000) -> dict[str, object]:
    """Steps the engine until idle; the final output of every request, by id."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("the engine did not finish")


def test_admission_waits_for_pages_then_completes(oracle_llm, solo_run) -> None:
    # 4 pages of 16 tokens; A's prompt and decode margin (40 + 16 tokens) take all of them, so B has to
    # wait for pages although a state slot is free.
    flags = dict(kv_capacity=64, max_context=64, max_concurrency=4)
    llm = oracle_llm(**flags)
    eng = llm.engine
    pa, pb = prompt(40, 1), prompt(10, 2)
    a = eng.add_request(pa, SamplingParams(max_tokens=20, **GREEDY))
    b = eng.add_request(pb, SamplingParams(max_tokens=5, **GREEDY))
    done = {}
    b_waited_steps = 0
    while eng.has_unfinished():
        stats = llm.stats()
        seq_b = eng.sequences.get(b)
        if a not in done and seq_b is not None:
            # while A runs, B waits: it is never refused, and never given pages A reserved
            assert seq_b.status.value == "waiting" or stats["running"] == 2
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if a not in done and llm.stats()["waiting"] == 1:
            assert llm.stats()["state_slots_free"] == 3 and llm.stats()["kv_pages_free"] == 0
            b_waited_steps += 1
    assert b_waited_steps > 10  # B waited through A's prefill and decode
    assert done[a].finish_reason == "length" and len(done[a].token_ids) == 20
    assert done[b].finish_reason == "length" and done[b].error is None
    assert done[b].token_ids == solo_run(pb, SamplingParams(max_tokens=5, **GREEDY), **flags).token_ids
    assert full(llm)


def test_generate_many_prompts_under_a_tight_pool(oracle_llm) -> None:
    """More prompts than slots, pages and the waiting queue hold: all finish, none is refused."""
    llm = oracle_llm(kv_capacity=96, max_context=64, max_concurrency=3, max_pending=2)
    prompts = [prompt(5 + 3 * i, 10 + i) for i in range(9)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY))
    assert [len(o.token_ids) for o in outs] == [6] * 9
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    assert full(llm)


@pytest.mark.parametrize("plen", [1, 25, 47, 48, 49])
def test_capacity_finish(oracle_llm, plen: int) -> None:
    """A sequence that reaches max_context ends with "length" after exactly max_context - len(prompt)
    tokens, however large its max_tokens; another request beside it is not cut short."""
    max_context = 50
    llm = oracle_llm(kv_capacity=160, max_context=max_context, max_concurrency=2)
    params = [SamplingParams(max_tokens=None, **GREEDY), SamplingParams(max_tokens=1000, **GREEDY)]
    outs = llm.generate([prompt(plen, 3), prompt(plen, 4)], params)
    for out in outs:
        assert out.finish_reason == "length"
        assert len(out.token_ids) == max_context - plen
    assert full(llm)


def test_max_tokens_finish_is_length_too(oracle_llm) -> None:
    llm = oracle_llm(max_context=50)
    (out,) = llm.generate([prompt(10, 5)], SamplingParams(max_tokens=7, **GREEDY))
    assert out.finish_reason == "length" and len(out.token_ids) == 7


def test_bounded_queue_error(oracle_llm) -> None:
    llm = oracle_llm(max_concurrency=1, max_pending=2)
    eng = llm.engine
    params = SamplingParams(max_tokens=3, **GREEDY)
    ids = [eng.add_request(prompt(8, i), params) for i in range(2)]
    with pytest.raises(QueueFull, match="max-pending"):
        eng.add_request(prompt(8, 9), params)
    assert llm.stats()["waiting"] == 2
    eng.step()  # one is admitted, which frees a place in the queue
    assert llm.stats()["waiting"] == 1 and llm.stats()["running"] == 1
    ids.append(eng.add_request(prompt(8, 9), params))
    with pytest.raises(QueueFull):
        eng.add_request(prompt(8, 10), params)
    done = drive(eng)
    assert sorted(done) == sorted(ids)
    assert all(len(o.token_ids) == 3 and o.finish_reason == "length" for o in done.values())
    assert full(llm)


def test_prompt_longer_than_max_context_rejected(oracle_llm) -> None:
    llm = oracle_llm(max_context=40)
    for n in (40, 41, 200):
        with pytest.raises(ValueError, match="max_context"):
            llm.engine.add_request(prompt(n, n), SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="max_context"):
            llm.generate([prompt(n, n)], SamplingParams(max_tokens=2))
    assert full(llm) and llm.engine.sequences == {}
    (out,) = llm.generate([prompt(39, 1)], SamplingParams(max_tokens=5, **GREEDY))
    assert out.finish_reason == "length" and len(out.token_ids) == 1
    assert full(llm)


def _step_until(eng, cond, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if cond():
            return
        eng.step()
    raise AssertionError("condition never reached")


def _abort_and_check_freed(llm, eng, seq, rid: str) -> dict:
    """Aborts rid; its pages and its slot must be free when abort returns. Returns the stats after."""
    pages = len(seq.cache.block_table)
    before = llm.stats()
    eng.abort(rid)
    after = llm.stats()
    assert after["kv_pages_free"] == before["kv_pages_free"] + pages
    assert after["state_slots_free"] == before["state_slots_free"] + 1
    assert after["running"] == before["running"] - 1
    return after


def test_abort_mid_prefill_frees_at_once(oracle_llm, solo_run) -> None:
    # one chunk a step: the abort lands between chunks, before the prompt's image point (96), whose image
    # would keep its pages (several chunks a step reach it in the first step)
    flags = dict(kv_capacity=256, max_context=128, max_concurrency=2, prefill_batch_chunks=1)
    llm = oracle_llm(**flags)
    eng = llm.engine
    other_prompt = prompt(12, 7)
    other_params = SamplingParams(max_tokens=30, **GREEDY)
    other = eng.add_request(other_prompt, other_params)
    victim = eng.add_request(prompt(100, 8), SamplingParams(max_tokens=20, **GREEDY))
    seq = eng.sequences[victim]
    _step_until(eng, lambda: 16 <= seq.num_computed < 100)
    assert seq.in_prefill and seq.cache is not None
    _abort_and_check_freed(llm, eng, seq, victim)
    assert seq.cache is None and seq.finish_reason == "abort"
    done = drive(eng)
    assert done[victim].finish_reason == "abort" and done[victim].token_ids == []
    # the request beside it is untouched
    assert done[other].token_ids == solo_run(other_prompt, other_params, **flags).token_ids
    assert full(llm)


def test_abort_mid_decode_frees_at_once(oracle_llm) -> None:
    llm = oracle_llm(kv_capacity=256, max_context=128, max_concurrency=2)
    eng = llm.engine
    victim = eng.add_request(prompt(20, 9), SamplingParams(max_tokens=50, **GREEDY))
    other = eng.add_request(prompt(20, 10), SamplingParams(max_tokens=12, **GREEDY))
    seq = eng.sequences[victim]
    _step_until(eng, lambda: len(seq.output_ids) >= 3)
    assert not seq.in_prefill and not seq.finished
    after = _abort_and_check_freed(llm, eng, seq, victim)
    eng.abort(victim)  # twice is harmless
    assert llm.stats() == after
    done = drive(eng)
    assert done[victim].finish_reason == "abort"
    assert 3 <= len(done[victim].token_ids) < 50
    assert done[other].finish_reason == "length" and len(done[other].token_ids) == 12
    assert full(llm)


def test_abort_while_waiting(oracle_llm) -> None:
    llm = oracle_llm(max_concurrency=1)
    eng = llm.engine
    first = eng.add_request(prompt(10, 1), SamplingParams(max_tokens=4, **GREEDY))
    queued = eng.add_request(prompt(10, 2), SamplingParams(max_tokens=4, **GREEDY))
    eng.step()
    assert llm.stats()["waiting"] == 1
    eng.abort(queued)
    assert llm.stats()["waiting"] == 0
    done = drive(eng)
    assert done[queued].finish_reason == "abort" and done[queued].token_ids == []
    assert len(done[first].token_ids) == 4
    assert full(llm)


def test_abort_everything_at_every_stage(oracle_llm) -> None:
    """Requests aborted at random points (waiting, prefill, decode, already finished) leave a full
    pool, and a later request still runs."""
    rng = random.Random(5)
    llm = oracle_llm(kv_capacity=192, max_context=96, max_concurrency=3)
    eng = llm.engine
    ids = [
        eng.add_request(
            prompt(rng.randint(1, 60), i), SamplingParams(max_tokens=rng.randint(1, 20), **GREEDY)
        )
        for i in range(10)
    ]
    for _ in range(30):
        eng.step()
        if rng.random() < 0.3:
            eng.abort(rng.choice(ids))
    for rid in ids:
        eng.abort(rid)
    s = llm.stats()
    assert s["kv_pages_free"] + s["kv_pages_in_images"] == s["kv_pages_total"]
    assert llm.stats()["state_slots_free"] == llm.stats()["state_slots_total"]
    drive(eng)
    assert full(llm) and eng.sequences == {}
    (out,) = llm.generate([prompt(5, 1)], SamplingParams(max_tokens=2, **GREEDY))
    assert len(out.token_ids) == 2


def test_several_prompt_chunks_a_step_stop_at_image_points(oracle_llm) -> None:
    """With pipeline stages a step sends up to `prefill_chunks` prompt chunks in (scheduler only: the
    stage tests run them): consecutive grid chunks of one prompt, then the next prompt's, and a prompt's
    run stops at its first image point (an image is the state the step leaves)."""
    llm = oracle_llm(prefill_chunk=16, max_concurrency=2, prefix_cache_images=4)
    eng = llm.engine
    sched = eng.scheduler
    sched.prefill_chunks = 3
    a = eng.add_request(prompt(100, 3), SamplingParams(max_tokens=2, **GREEDY))
    b = eng.add_request(prompt(20, 4), SamplingParams(max_tokens=2, **GREEDY))
    seq_a, seq_b = eng.sequences[a], eng.sequences[b]
    assert 96 in seq_a.image_points and 80 not in seq_a.image_points
    plan = sched.schedule()
    assert [(ch.seq, ch.start, ch.end, ch.sample) for ch in plan.prefills] == [
        (seq_a, 0, 16, False),
        (seq_a, 16, 32, False),
        (seq_a, 32, 48, False),
    ]
    seq_a.num_computed = 48  # as the step's update leaves it
    plan = sched.schedule()
    assert [(ch.seq, ch.start, ch.end) for ch in plan.prefills] == [
        (seq_a, 48, 64),
        (seq_a, 64, 80),
        (seq_a, 80, 96),
    ]
    seq_a.num_computed = 96  # its last boundary, an image point: the run above ended there
    plan = sched.schedule()
    # A ends; B's run stops at 16, its image point, though a third chunk would fit the step
    assert [(ch.seq, ch.start, ch.end, ch.sample) for ch in plan.prefills] == [
        (seq_a, 96, 100, True),
        (seq_b, 0, 16, False),
    ]
    for rid in (a, b):
        eng.abort(rid)


def test_a_step_that_decodes_runs_fewer_prompt_chunks(oracle_llm) -> None:
    """Decodes first: a long prompt beside a decoding sequence gets `prefill_chunks_beside_decodes` chunks
    a step (auto: one in one process), alone all of `prefill_chunks`; the outputs are those of one request
    at a time (C1)."""
    from nextserve.config import ConfigError
    from nextserve.engine_config import EngineConfig

    assert EngineConfig(prefill_batch_chunks=4).prefill_chunks_with_decodes() == 1
    assert (
        EngineConfig(prefill_batch_chunks=4, prefill_chunks_beside_decodes=9).prefill_chunks_with_decodes()
        == 4
    )
    assert EngineConfig(pipeline_stages=3).prefill_chunks_with_decodes() == 3
    for bad in (0, 65, True, "one"):
        with pytest.raises(ConfigError, match="prefill_chunks_beside_decodes must be"):
            EngineConfig(prefill_chunks_beside_decodes=bad)
    llm = oracle_llm(prefill_chunk=16, max_concurrency=2, prefill_batch_chunks=4, prefix_cache=False)
    eng, sched = llm.engine, llm.engine.scheduler
    assert (sched.prefill_chunks, sched.beside_decodes) == (4, 1)
    short = eng.add_request(prompt(10, 5), SamplingParams(max_tokens=40, **GREEDY))
    while not eng.sequences[short].output_ids:
        eng.step()
    long = eng.add_request(prompt(100, 6), SamplingParams(max_tokens=3, **GREEDY))
    plan = sched.schedule()
    assert len(plan.decodes) == 1 and [(ch.start, ch.end) for ch in plan.prefills] == [(0, 16)]
    eng.abort(short)
    plan = sched.schedule()  # the long prompt alone now
    assert not plan.decodes and [(ch.start, ch.end) for ch in plan.prefills] == [
        (0, 16),
        (16, 32),
        (32, 48),
        (48, 64),
    ]
    eng.abort(long)
    drive(eng)
    prompts = [prompt(10, 5), prompt(100, 6)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    batched = oracle_llm(prefill_chunk=16, max_concurrency=2, prefill_batch_chunks=4)
    together = batched.generate(prompts, params)
    alone = [oracle_llm(prefill_chunk=16, max_concurrency=1).generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
