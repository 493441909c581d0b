"""Async scheduling (engine/engine.py: a step of greedy decodes is launched before the host reads the
previous one's tokens): the same outputs as the synchronous engine, with stop tokens, stop strings,
max_tokens, max_context, aborts and sampled requests finishing or joining while a step is in flight; every
page and slot free at the end; the pending-id resolution against its reference."""

from __future__ import annotations

import random

import pytest
import torch
from pool_check import assert_pool_full
from test_batched_exactness import FLAGS
from triton_interp import DEV

from nextserve import LLM, SamplingParams
from nextserve.config import ConfigError
from nextserve.engine_config import EngineConfig
from nextserve.ops.tokens import resolve_pending_ids

EOS = 1  # hf_oracle.TINY


def greedy_workload(seed: int, n: int = 20) -> list[tuple[list[int], SamplingParams]]:
    """Mostly plain greedy requests (launched steps), ending by eos, a stop token, max_tokens or the
    context; every fourth samples or asks for logprobs (a synchronous step between launched ones)."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        ids = [rng.randrange(2, 256) for _ in range(rng.randint(1, 60))]
        plain = i % 4 != 3
        params = SamplingParams(
            max_tokens=None if i == 5 else rng.choice([1, 2, 3, 9, 30]),  # 5: runs to max_context
            temperature=0.0 if plain or i % 8 == 3 else 0.8,
            logprobs=None if plain else 2,
            seed=rng.getrandbits(32),
            ignore_eos=i == 5 or rng.random() < 0.5,
            stop_token_ids=[rng.randrange(2, 256) for _ in range(40)] if i % 3 == 0 and i != 5 else [],
        )
        reqs.append((ids, params))
    return reqs


def _same(a, b) -> None:
    assert a.error is None and b.error is None, (a.error, b.error)
    assert (a.token_ids, a.finish_reason, a.logprobs, a.text) == (
        b.token_ids,
        b.finish_reason,
        b.logprobs,
        b.text,
    )


def _all_free(llm) -> None:
    assert_pool_full(llm)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("bad", ["yes", 1, None, 0.0])
def test_async_scheduling_must_be_a_bool(bad) -> None:
    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineConfig(async_scheduling=bad)


def test_the_cli_flag_sets_it() -> None:
    import argparse

    from nextserve.cli import add_engine_flags, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_config_from_args(p.parse_args([])).async_scheduling is True
    assert engine_config_from_args(p.parse_args(["--no-async-scheduling"])).async_scheduling is False
    with pytest.raises(SystemExit):
        p.parse_args(["--async-scheduling=maybe"])


def test_async_equals_sync(oracle_llm) -> None:
    reqs = greedy_workload(seed=7)
    outs = {}
    for on in (True, False):
        llm = oracle_llm(**FLAGS, kv_capacity=960, max_concurrency=6, async_scheduling=on)
        outs[on] = llm.generate([ids for ids, _ in reqs], [p for _, p in reqs])
        _all_free(llm)
        launches = llm.engine.runner._launches
        assert launches > 50 if on else launches == 0, launches
    for a, b in zip(outs[True], outs[False], strict=True):
        _same(a, b)
    reasons = {o.finish_reason for o in outs[True]}
    assert reasons == {"stop", "length"}, reasons
    ctx = FLAGS["max_context"]
    assert any(len(o.token_ids) == ctx - len(ids) for o, (ids, _) in zip(outs[True], reqs, strict=True))


def test_stop_strings_while_a_step_is_in_flight(tiny_model_dir) -> None:
    """A stop string ends a request on the host a step after the step that sampled it was launched."""
    prompts = ["the cat sat on", "a b c d e f", "hello", "once upon a time"]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, stop=[s], ignore_eos=True)
        for s in ("e", " ", "o", "t")
    ]
    outs = {}
    for on in (True, False):
        llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", max_concurrency=4, page_size=16,
                  kv_capacity=512, max_context=128, async_scheduling=on)  # fmt: skip
        outs[on] = llm.generate(prompts, params)
        _all_free(llm)
    assert any(o.finish_reason == "stop" for o in outs[True])
    for a, b in zip(outs[True], outs[False], strict=True):
        _same(a, b)


def test_abort_while_a_step_is_in_flight(oracle_llm) -> None:
    llm = oracle_llm(**FLAGS, kv_capacity=512, async_scheduling=True)
    eng = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    keep, drop = eng.add_request(list(range(2, 30)), params), eng.add_request(list(range(5, 40)), params)
    while eng._launched is None or not eng.sequences[drop].output_ids:
        eng.step()
    eng.abort(drop)  # its row of the launched step is dropped when the step is read
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.finish_reason for o in outs if o.request_id == drop] == ["abort"]
    (kept,) = [o for o in outs if o.request_id == keep and o.finished]
    ref = oracle_llm(**FLAGS, kv_capacity=512, async_scheduling=False).generate([list(range(2, 30))], params)[
        0
    ]
    _same(kept, ref)
    _all_free(llm)


def test_a_sequence_at_its_budget_is_not_scheduled_with_its_last_token_pending(oracle_llm) -> None:
    llm = oracle_llm(**FLAGS, kv_capacity=512, async_scheduling=True)
    eng = llm.engine
    rid = eng.add_request([3, 4, 5], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    seq = eng.sequences[rid]
    plans = []
    schedule = eng.scheduler.schedule
    eng.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    while eng.has_unfinished():
        eng.step()
    assert len(seq.output_ids) == 3 and seq.finish_reason == "length"
    # prefill (token 1), launched decodes for tokens 2 and 3, then nothing: token 3 ends it
    assert [len(p.prefills) + len(p.decodes) for p in plans] == [1, 1, 1, 0]


@pytest.mark.parametrize("n", [1, 7, 300])
def test_resolve_pending_ids_kernel_equals_reference(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    tokens = torch.randint(0, 1000, (64,), generator=g)
    ids = torch.randint(0, 1000, (n,), generator=g)
    rows = torch.randint(0, 64, (n,), generator=g)
    ids = torch.where(torch.rand(n, generator=g) < 0.5, -1 - rows, ids)
    want = torch.where(ids >= 0, ids, tokens[(-1 - ids).clamp(min=0)])
    ref = ids.clone()
    resolve_pending_ids(ref, tokens)  # the torch reference on the CPU
    assert torch.equal(ref, want)
    from nextserve.ops.triton.tokens import triton_resolve_pending_ids

    got = ids.to(DEV)
    triton_resolve_pending_ids(got, tokens.to(DEV))  # the kernel (Triton's interpreter without a GPU)
    assert torch.equal(got.cpu(), want)
