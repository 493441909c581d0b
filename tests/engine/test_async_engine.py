"""AsyncEngine: adds and aborts go through the engine thread's inbox and never wait for a step; bad requests
are refused at once; a later failure arrives as an "error" output; an abort frees before its end is seen."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from cpu_flags import CPU_FLAGS

from nextserve.engine.async_engine import AsyncEngine
from nextserve.engine.output_stream import OutputStream
from nextserve.engine.sampling import SamplingParams
from nextserve.engine.scheduler import QueueFull
from nextserve.engine_config import EngineConfig

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

    def gated(*args, **kwargs):  # NOTE: the engine thread calls step(deltas=True)
        gate.wait(10)
        return step(*args, **kwargs)

    eng.engine.step = gated
    return gate


async def finish(stream: OutputStream):
    while not stream.finished:
        await asyncio.wait_for(stream.next(), 10)
    (out,) = stream.outputs.values()
    return out


def pool_full(s: dict[str, int]) -> bool:
    return (
        s["kv_pages_free"] + s["kv_pages_in_images"] == s["kv_pages_total"]
        and s["state_slots_free"] == s["state_slots_total"]
    )


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


def test_a_step_that_raises_ends_its_requests_instead_of_looping(engine, caplog):
    """A raise out of engine.step (a bug, or a pipeline that broke) would raise again at the next step
    with the same requests: the engine thread ends them with the error, logs once, and serves on."""
    calls, step = [], engine.engine.step

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("boom")

    engine.engine.step = broken

    async def run():
        return await finish(engine.add_request([5, 6, 7], LONG, "x"))

    out = asyncio.run(run())
    assert out.finish_reason == "error" and "engine step failed: RuntimeError: boom" in out.error
    time.sleep(0.2)
    assert len(calls) == 1 and engine.is_alive()
    engine.engine.step = step

    async def again():
        return await finish(engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), "y"))

    assert asyncio.run(again()).finish_reason == "length"


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
        stream = engine.add_request([5, 6, 7, 8], LONG, "r")
        while len(getattr(stream.outputs.get("r"), "token_ids", ())) < 3:
            await stream.next()
        engine.abort("r")
        out = await finish(stream)
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


def test_outputs_arrive_as_deltas_and_add_up_to_the_whole(tiny_model_dir):
    """The stream's cumulative output equals the synchronous engine's, tokens and logprobs, however the
    reader's pace splits it into deltas."""
    from nextserve import LLM

    params = SamplingParams(max_tokens=40, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    (want,) = LLM(str(tiny_model_dir), **FLAGS).generate([[5, 6, 7]], params)
    eng = AsyncEngine(EngineConfig(model=str(tiny_model_dir), **FLAGS))
    try:

        async def run():
            stream = eng.add_request([5, 6, 7], params, "d")
            while not stream.finished:
                await asyncio.sleep(0.02)  # a reader slower than the steps: deltas merge while unread
                await stream.next()
            return stream.outputs["d"]

        got = asyncio.run(run())
    finally:
        eng.shutdown()
    assert got.token_ids == want.token_ids and got.text == want.text
    assert [(lp.token_id, lp.logprob, lp.top) for lp in got.logprobs] == [
        (lp.token_id, lp.logprob, lp.top) for lp in want.logprobs
    ]


@pytest.mark.parametrize("unread, aborted", [(64, False), (40, True)])
def test_a_reader_too_far_behind_is_aborted(tiny_model_dir, unread, aborted):
    """A client that reads nothing while 64 tokens arrive: kept at a limit of 64 unread, aborted at 40."""
    eng = AsyncEngine(EngineConfig(model=str(tiny_model_dir), **FLAGS), max_unread=unread)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    try:

        async def run():
            stream = eng.add_request([5, 6, 7], params, "slow")
            deadline = time.monotonic() + 30
            while (eng.num_waiting() or eng.engine.sequences) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # never reads until the engine is done with it
            await asyncio.sleep(0.05)
            await stream.next()
            return stream.outputs["slow"]

        out = asyncio.run(run())
    finally:
        eng.shutdown()
    assert out.finished and out.finish_reason == ("abort" if aborted else "length")
    assert (len(out.token_ids) < 64) if aborted else (len(out.token_ids) == 64)
    assert pool_full(eng.stats())


def test_unread_outputs_cost_memory_linear_in_the_output():
    """6,000 steps of one token with 20 top logprobs each, none read: the stream holds one copy of what is
    unread (deltas merged), not a copy of the whole output per step (which was 275 MB)."""
    import tracemalloc

    from nextserve.engine.outputs import RequestOutput
    from nextserve.engine.sampling import TokenLogprob

    async def run() -> int:
        stream = OutputStream(asyncio.get_running_loop(), max_unread=10**9)
        tracemalloc.start()
        for i in range(6000):
            lp = TokenLogprob(i, -1.0, [(j, -2.0) for j in range(20)])
            stream.push(RequestOutput("r", None, [1], [i], "x" * i, logprobs=[lp], offset=i))
        size, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        (out,) = await stream.next()
        assert out.token_ids == list(range(6000)) and len(out.logprobs) == 6000
        return size

    assert asyncio.run(run()) < 30 * 2**20
