"""Pages as sequences grow and exact preemption to host memory (issue 19, C1, C2): requests without
max_tokens take pages as they decode, a pool that runs short preempts the request that arrived last to
host memory, and it resumes from there bit for bit, ahead of new prompts."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from nextserve import SamplingParams

MAX_CONTEXT = 96
FOUR_CONTEXTS = dict(kv_capacity=4 * MAX_CONTEXT, max_context=MAX_CONTEXT, prefix_cache_images=0)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 256) for _ in range(n)]


def agent_params(i: int) -> SamplingParams:
    """No max_tokens (agent clients send none): greedy for even i, seeded sampling for odd i."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=None, temperature=0.0, logprobs=2)
    return SamplingParams(max_tokens=None, temperature=0.8, seed=100 + i, logprobs=2)


def drained(llm) -> bool:
    """Every page and slot back (prefix images dropped first), no request left, no host copy left."""
    llm.engine.clear_prefix_cache()
    s = llm.stats()
    return (
        s["kv_pages_free"] == s["kv_pages_total"]
        and s["state_slots_free"] == s["state_slots_total"]
        and s["waiting"] == s["running"] == s["preempted_waiting"] == 0
    )


def same(a, b) -> bool:
    return a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.logprobs == b.logprobs


def test_admission_reserves_the_prompt_and_a_margin_not_the_context(oracle_llm) -> None:
    """A request without max_tokens used to reserve max_context (here the whole pool), so a second one
    waited; now both run at once, and pages are taken page by page as they decode."""
    llm = oracle_llm(kv_capacity=2 * MAX_CONTEXT, max_context=2 * MAX_CONTEXT, prefix_cache_images=0)
    eng = llm.engine
    a = eng.add_request(prompt(20, 1), SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
    b = eng.add_request(prompt(12, 2), SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
    eng.step()
    assert llm.stats()["running"] == 2 and llm.stats()["waiting"] == 0
    seq_a = eng.sequences[a]
    held = [len(seq_a.cache.block_table)]
    while seq_a.num_tokens < 70:
        eng.step()
        held.append(len(seq_a.cache.block_table))
    assert held[0] == 3  # 20 prompt tokens + a 16-token margin: 3 pages of 16, not 12
    # one more page each time it nears a boundary (its step's positions and the lookahead reserved)
    assert held == sorted(held) and held[-1] == -(-(70 + eng.scheduler.lookahead) // 16)
    eng.abort(a)
    eng.abort(b)
    eng.step()
    assert drained(llm)


def test_32_agent_requests_under_a_pool_of_4_contexts_all_finish_as_alone(oracle_llm, solo_run) -> None:
    prompts = [prompt(8 + (7 * i) % 40, 500 + i) for i in range(32)]
    params = [agent_params(i) for i in range(32)]
    llm = oracle_llm(**FOUR_CONTEXTS, max_concurrency=8)
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["preempted_resumes"] == stats["preemptions"]
    for p, o in zip(prompts, outs, strict=True):
        assert o.error is None and o.finish_reason in ("stop", "length")
        if o.finish_reason == "length":  # only reaching max_context itself ends a request by length
            assert len(p) + len(o.token_ids) == MAX_CONTEXT
    for i in range(0, 32, 3):  # the serial reference, alone on a pool that never runs short
        alone = solo_run(prompts[i], params[i], kv_capacity=MAX_CONTEXT, max_context=MAX_CONTEXT)
        assert same(outs[i], alone), i
    assert drained(llm)


@pytest.mark.parametrize(
    "flags",
    [
        dict(async_scheduling=False),
        dict(async_scheduling=True),
        dict(speculative_method="ngram", speculative_tokens=3),
        dict(prefix_cache_images=4, host_state_slots=4),  # images dropped first, the host store shared
    ],
    ids=["sync", "async", "ngram", "images"],
)
def test_preempted_request_equals_its_unpreempted_run(oracle_llm, flags) -> None:
    """Three long greedy requests on a pool of two contexts: the last to arrive is preempted when the
    others grow into its pages, and every output equals the run on a pool that holds them all."""
    prompts = [prompt(30, 11), prompt(25, 12), prompt(33, 13)]
    params = [SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True, logprobs=1)] * 2
    params.append(SamplingParams(max_tokens=None, temperature=0.9, seed=5, ignore_eos=True, logprobs=1))
    base = dict(max_context=MAX_CONTEXT, max_concurrency=3) | flags
    tight = oracle_llm(**(base | {"kv_capacity": 2 * MAX_CONTEXT}))
    roomy = oracle_llm(**(base | {"kv_capacity": 3 * MAX_CONTEXT}))
    got, want = tight.generate(prompts, params), roomy.generate(prompts, params)
    assert tight.stats()["preemptions"] >= 1 and roomy.stats()["preemptions"] == 0
    assert all(same(a, b) for a, b in zip(got, want, strict=True))
    assert all(len(p) + len(o.token_ids) == MAX_CONTEXT for p, o in zip(prompts, got, strict=True))
    assert drained(tight) and drained(roomy)


def _until_one_is_preempted(oracle_llm, seed: int):
    """Three long greedy requests on a pool of two contexts, stepped until one is preempted."""
    llm = oracle_llm(kv_capacity=2 * MAX_CONTEXT, max_context=MAX_CONTEXT, max_concurrency=4,
                     prefix_cache_images=0)  # fmt: skip
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    ids = [llm.engine.add_request(prompt(30, seed + i), params) for i in range(3)]
    while not llm.stats()["preempted_waiting"]:
        llm.engine.step()
    return llm, ids


def test_preempted_requests_resume_ahead_of_new_prompts(oracle_llm) -> None:
    llm, ids = _until_one_is_preempted(oracle_llm, seed=20)
    eng = llm.engine
    late = eng.add_request(prompt(10, 99), SamplingParams(max_tokens=4, temperature=0.0))
    queue = list(eng.scheduler.waiting)
    preempted = [s for s in queue if eng.scheduler.swapper.holds(s)]
    assert preempted and queue[: len(preempted)] == preempted and queue[-1] is eng.sequences[late]
    assert max(s.arrival for s in preempted) == 2  # the one that arrived last went first
    resumed_before_late = None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == late and resumed_before_late is None:
                resumed_before_late = llm.stats()["preempted_resumes"] >= 1
    assert resumed_before_late and all(i not in eng.sequences for i in ids)
    assert drained(llm)


def test_a_full_host_budget_keeps_the_request_waiting_on_the_device(oracle_llm) -> None:
    """--host-kv-mib 0 holds no copy: the sequence that needs a page waits on the device until another
    finishes (or, when no sequence could run at all, is preempted past the budget): nothing fails."""
    prompts = [prompt(30, 31), prompt(25, 32)]
    params = [SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)]  # fmt: skip
    llm = oracle_llm(kv_capacity=144, max_context=MAX_CONTEXT, host_kv_mib=0, prefix_cache_images=0)
    roomy = oracle_llm(kv_capacity=4 * MAX_CONTEXT, max_context=MAX_CONTEXT, prefix_cache_images=0)
    got, want = llm.generate(prompts, params), roomy.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.finish_reason == "length" and o.error is None for o in got)
    assert drained(llm)


def test_abort_of_a_preempted_request_drops_its_host_copy(oracle_llm) -> None:
    llm, ids = _until_one_is_preempted(oracle_llm, seed=40)
    eng = llm.engine
    (victim,) = [s for s in eng.scheduler.waiting if eng.scheduler.swapper.holds(s)]
    eng.abort(victim.request_id)
    assert llm.stats()["preempted_waiting"] == 0 and eng.scheduler.swapper.nbytes == 0
    while eng.has_unfinished():
        eng.step()
    assert all(i not in eng.sequences for i in ids)
    assert drained(llm)


class GrowthMachine(RuleBasedStateMachine):
    """Requests arrive, decode, grow, get preempted, resume, get aborted and finish in any order on a
    pool of two contexts; the books always balance, and at the end the pool and slots are full again."""

    def __init__(self) -> None:
        super().__init__()
        self.llm = MACHINE_LLM()
        self.eng = self.llm.engine
        self.n = 0

    @rule(length=st.integers(1, 60), max_tokens=st.one_of(st.none(), st.integers(1, 40)))
    def arrive(self, length: int, max_tokens: int | None) -> None:
        if len(self.eng.scheduler.waiting) < 8:
            p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            self.eng.add_request(prompt(length, self.n), p)
            self.n += 1

    @rule(steps=st.integers(1, 12))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self.eng.step()

    @precondition(lambda self: bool(self.eng.sequences))
    @rule(pick=st.integers(0, 1000))
    def abort(self, pick: int) -> None:
        live = sorted(self.eng.sequences)
        self.eng.abort(live[pick % len(live)])

    @invariant()
    def books_balance(self) -> None:
        s, pool = self.eng.scheduler, self.eng.pool
        held = [p for q in s.running for p in q.cache.block_table]
        assert all(q.cache is None for q in s.waiting)
        assert sum(pool.refcount) == len(held) and pool.num_free + len(set(held)) == pool.num_pages
        assert not any(s.swapper.holds(q) for q in s.running)
        assert len(s.swapper.copies) == sum(s.swapper.holds(q) for q in s.waiting)

    def teardown(self) -> None:
        while self.eng.has_unfinished():
            self.eng.step()
        assert drained(self.llm)


def test_growth_preemption_state_machine(oracle_llm) -> None:
    global MACHINE_LLM
    MACHINE_LLM = lambda: oracle_llm(  # noqa: E731
        kv_capacity=2 * MAX_CONTEXT, max_context=MAX_CONTEXT, max_concurrency=4, prefix_cache_images=0
    )
    run_state_machine_as_test(
        GrowthMachine,
        settings=settings(
            max_examples=12,
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


MACHINE_LLM = None
