"""Load, disconnects and back-pressure: many streaming clients, clients that leave, a full queue."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import openai
import pytest
from live_server import MODEL_NAME, assert_pool_full, live_server, post_and_hold, wait_until

MSGS = [{"role": "user", "content": "Tell me a story."}]


def test_32_streaming_clients_a_quarter_disconnect(tiny_model_dir):
    # 4 slots and a 64-page pool: the leavers reserve 27 pages each, so requests wait for slots and pages.
    with live_server(tiny_model_dir, max_concurrency=4, kv_capacity=1024, max_context=512) as srv:
        engine = srv.engine.engine
        gone_after: list[float] = []

        async def client(i: int, aclient) -> dict:
            leaver = i % 4 == 3
            stream = await aclient.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": f"Story number {i}."}],
                max_tokens=400 if leaver else 16,
                seed=i,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": leaver},
            )
            chunks = []
            async for chunk in stream:
                chunks.append(chunk)
                if leaver and len(chunks) == 3:
                    rid = chunk.id
                    await stream.close()
                    t0 = time.monotonic()
                    while rid in engine.sequences and time.monotonic() - t0 < 5:
                        await asyncio.sleep(0.005)
                    gone_after.append(time.monotonic() - t0)
                    return {"leaver": True, "chunks": chunks}
            return {"leaver": leaver, "chunks": chunks}

        async def run_all() -> list[dict]:
            async with srv.async_client(timeout=120, max_retries=0) as aclient:
                return await asyncio.gather(*(client(i, aclient) for i in range(32)))

        results = asyncio.run(run_all())
        finished = [r for r in results if not r["leaver"]]
        assert len(finished) == 24 and len(gone_after) == 8
        for r in finished:
            chunks = r["chunks"]
            assert chunks[0].choices[0].delta.role == "assistant"
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert reasons in (["stop"], ["length"])
            assert chunks[-1].usage is not None and 0 < chunks[-1].usage.completion_tokens <= 16
        # A leaver's request is aborted at once, long before its 400 tokens could be generated.
        assert max(gone_after) < 1.0, gone_after
        assert_pool_full(srv.wait_idle())
        r = srv.client().chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert_pool_full(srv.wait_idle())


@pytest.fixture(scope="module")
def one_slot(tiny_model_dir):
    """One slot, a one-request queue, and keep-alives after 0.1 s of quiet."""
    with live_server(
        tiny_model_dir, max_concurrency=1, max_pending=1, kv_capacity=512, max_context=256, keepalive_s=0.1
    ) as srv:
        yield srv


def _raw_stream(srv, body: dict, out: dict, path: str = "/v1/chat/completions") -> None:
    """Streams a request over a plain connection, recording every SSE line."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out["status"] = resp.status
    out["lines"] = [line.decode().rstrip("\n") for line in resp]
    conn.close()


def test_full_queue_gets_503_and_waiters_get_keepalives(one_slot):
    srv = one_slot
    client = srv.client(max_retries=0)
    # A occupies the only slot...
    a = client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(a))
    assert wait_until(lambda: srv.engine.stats()["running"] == 1)
    # ...B waits in the one-place queue (and hears keep-alives meanwhile)...
    b: dict = {}
    tb = threading.Thread(
        target=_raw_stream, args=(srv, {"messages": MSGS, "max_tokens": 4, "stream": True}, b)
    )
    tb.start()
    assert wait_until(lambda: srv.engine.stats()["waiting"] == 1)
    # ...so C is turned away with 503 and Retry-After.
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=4)
    assert info.value.status_code == 503
    assert info.value.response.headers["retry-after"] == "1"
    assert info.value.body["code"] == "queue_full"
    time.sleep(0.35)
    a.close()  # A leaves; B runs
    tb.join(30)
    assert b["status"] == 200
    lines = b["lines"]
    assert lines.count(": keep-alive") >= 2
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
    assert_pool_full(srv.wait_idle())


def test_a_queued_messages_stream_opens_with_message_start(one_slot):
    """Bug: a /v1/messages stream quiet for keepalive_s before its first output (queued, or a slow first
    token: CI's machine once took 5 s) sent `ping` events before `message_start`, which Anthropic's streams
    never do. It now hears SSE comments until message_start, pings after."""
    srv = one_slot
    a = srv.client(max_retries=0).chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(a))
    assert wait_until(lambda: srv.engine.stats()["running"] == 1)
    b: dict = {}
    body = {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 4, "stream": True}
    tb = threading.Thread(target=_raw_stream, args=(srv, body, b, "/v1/messages"))
    tb.start()
    assert wait_until(lambda: srv.engine.stats()["waiting"] == 1)
    time.sleep(0.35)
    a.close()
    tb.join(30)
    assert b["status"] == 200
    events = [line.removeprefix("event: ") for line in b["lines"] if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop", events
    assert b["lines"].count(": keep-alive") >= 2
    assert_pool_full(srv.wait_idle())


def test_non_streamed_client_that_leaves_is_aborted(one_slot):
    srv = one_slot
    sock = post_and_hold(
        srv.port, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 230, "ignore_eos": True}
    )
    assert wait_until(lambda: srv.engine.stats()["running"] == 1)
    before = srv.engine.engine.sequences.copy()
    sock.close()
    assert wait_until(lambda: not srv.engine.engine.sequences, timeout=1.0), before
    assert_pool_full(srv.wait_idle())
    metrics = srv.request("GET", "/metrics")[2].decode()
    assert 'nextserve_requests_finished_total{finish_reason="client_disconnect"}' in metrics


def test_default_max_tokens_runs_to_max_context(one_slot):
    # Chat without max_tokens runs until max_context (as vLLM); completions default to 16 tokens.
    client = one_slot.client()
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.total_tokens == 256 and r.choices[0].finish_reason == "length"
    r = client.completions.create(
        model=MODEL_NAME, prompt="x", temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 16
    assert_pool_full(one_slot.wait_idle())
