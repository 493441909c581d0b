"""AsyncEngine: adds and aborts go through the engine thread's inbox and never wait for a step; bad requests
are refused at once; a later failure arrives as an "error" output; an abort frees before its end is seen."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from cpu_flags import CPU_FLAGS

from nextserve.config import EngineConfig
from nextserve.engine.async_engine import AsyncEngine
from nextserve.engine.sampling import SamplingParams
from nextserve.engine.scheduler import QueueFull

FLAGS = CPU_FLAGS | dict(max_concurrency=2, kv_capacity=512, max_context=256, max_pending=2)
LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(tiny_model_dir):
    eng = AsyncEngine(EngineConfig(model=str(tiny_model_dir), **FLAGS))
    yield eng
    eng.shutdown()


def gate_steps(eng: AsyncEngine) -> threading.Event:
    """Makes every engine step wait for the returned event (a step that takes as long as the test likes)."""
    gate, step = threading.Event(), eng.engine.step

    def gated():
        gate.wait(10)
        return step()

    eng.engine.step = gated
    return gate


async def finish(queue: asyncio.Queue):
    while not (out := await asyncio.wait_for(queue.get(), 10)).finished:
        pass
    return out


def pool_full(s: dict[str, int]) -> bool:
    return s["kv_pages_free"] == s["kv_pages_total"] and s["state_slots_free"] == s["state_slots_total"]


def test_add_and_refusals_do_not_wait_for_a_step(engine):
    gate = gate_steps(engine)

    async def run():
        first = engine.add_request([5, 6, 7], LONG, "a")
        await asyncio.sleep(0.05)  # the engine thread is now inside a step that waits for the gate
        t0 = time.monotonic()
        second = engine.add_request([5, 6], LONG, "b")
        for prompt, rid in (([], "c"), ([10**6], "c"), ([1] * 300, "c"), ([5], "b")):
            with pytest.raises(ValueError):
                engine.add_request(prompt, LONG, rid)
        with pytest.raises(QueueFull):  # "a" and "b" wait (max_pending 2)
            engine.add_request([5], LONG, "c")
        assert time.monotonic() - t0 < 0.5 and not gate.is_set()
        gate.set()
        for rid in ("a", "b"):
            engine.abort(rid)
        return [await finish(q) for q in (first, second)]

    outs = asyncio.run(run())
    assert all(o.finish_reason == "abort" for o in outs)
    assert pool_full(engine.stats())


def test_failure_on_the_engine_thread_is_an_error_output(engine):
    def refuse(*args, **kwargs):
        raise RuntimeError("no room")

    engine.engine.add_request = refuse

    async def run():
        return await finish(engine.add_request([5, 6, 7], LONG, "x"))

    out = asyncio.run(run())
    assert out.finish_reason == "error" and "no room" in out.error and out.prompt_token_ids == [5, 6, 7]
    assert engine.is_alive()


def test_abort_frees_pages_and_slot_before_the_end_is_seen(engine):
    async def run():
        queue = engine.add_request([5, 6, 7, 8], LONG, "r")
        for _ in range(3):
            await queue.get()
        engine.abort("r")
        out = await finish(queue)
        return out, engine.engine.stats(), "r" in engine.engine.sequences

    out, stats, known = asyncio.run(run())
    assert out.finish_reason == "abort" and not known
    assert pool_full(stats)


def test_is_alive_until_shutdown(engine):
    assert engine.is_alive()
    engine.shutdown()
    assert not engine.is_alive()

    async def late():
        async for _ in engine.generate([5], LONG, "late"):
            pass

    with pytest.raises(RuntimeError):
        asyncio.run(late())
