"""Prefix reuse through the chat API, on by default: an agent's next turn and a rewritten last message
resume from stored images (usage.prompt_tokens_details.cached_tokens), with the answer a cold server
(--no-prefix-cache) gives; tenants (API keys) and cache_salt never share images."""

from __future__ import annotations

import openai
import pytest
from live_server import MODEL_NAME, live_server

SYSTEM = "You are a careful coding agent. " * 12
HISTORY = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Write a function that reverses a list, with a docstring and tests."},
    {"role": "assistant", "content": "def rev(xs):\n    return xs[::-1]\n" * 4},
]


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    flags = dict(prefill_chunk=32)
    with live_server(tiny_model_dir, **flags) as warm:  # no prefix flags: reuse is the default
        with live_server(tiny_model_dir, prefix_cache=False, **flags) as cold:
            yield warm, cold


def _chat(srv, messages):
    r = srv.client().chat.completions.create(
        model="tiny-test", messages=messages, max_tokens=8, temperature=0
    )
    return r.choices[0].message.content, r.usage


def test_next_turn_and_rewritten_message_resume_exactly(servers) -> None:
    warm, cold = servers
    turn1 = HISTORY + [{"role": "user", "content": "Now make it generic over any sequence type."}]
    _, u1 = _chat(warm, turn1)
    assert u1.prompt_tokens_details.cached_tokens == 0
    # The client rewrites its last message: the checkpoint before it serves the new one.
    rewritten = HISTORY + [{"role": "user", "content": "Actually, make it work on strings too, please."}]
    text, u2 = _chat(warm, rewritten)
    assert u2.prompt_tokens_details.cached_tokens > 0
    assert u2.prompt_tokens_details.cached_tokens % 32 == 0
    assert text == _chat(cold, rewritten)[0]
    # The next turn appends to the conversation: it resumes at least as far.
    turn2 = rewritten + [{"role": "assistant", "content": text}, {"role": "user", "content": "Thanks."}]
    text3, u3 = _chat(warm, turn2)
    assert u3.prompt_tokens_details.cached_tokens >= u2.prompt_tokens_details.cached_tokens
    assert text3 == _chat(cold, turn2)[0]
    s = warm.wait_idle()
    assert s["state_slots_free"] == s["state_slots_total"]
    assert s["prefix_hits"] >= 2 and s["prefix_misses"] >= 1


def _cached(client, messages, **extra) -> int:
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0, extra_body=extra or None
    )
    return r.usage.prompt_tokens_details.cached_tokens


def test_tenants_and_cache_salts_never_share_images(tiny_model_dir) -> None:
    turn = HISTORY + [{"role": "user", "content": "Now make it generic over any sequence type."}]
    with live_server(tiny_model_dir, api_key=("key-a", "key-b"), prefill_chunk=32) as srv:
        a, b = (openai.OpenAI(base_url=srv.base_url, api_key=k, max_retries=0) for k in ("key-a", "key-b"))
        assert _cached(a, turn) == 0
        assert _cached(b, turn) == 0  # the same prompt from the other tenant: nothing resumed
        assert _cached(a, turn) > 0  # its own tenant's image
        assert _cached(a, turn, cache_salt="project-1") == 0  # a salt splits the tenant's cache
        assert _cached(a, turn, cache_salt="project-1") > 0
        assert _cached(b, turn, cache_salt="project-1") == 0  # the same salt under another key
        assert _cached(b, turn) > 0
        for bad in ("", 7, ["x"], "s" * 257):
            with pytest.raises(openai.BadRequestError) as e:
                _cached(a, turn, cache_salt=bad)
            assert e.value.body["param"] == "cache_salt", bad
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.base_url, api_key="key-c", max_retries=0).models.list()


def test_agent_requests_without_max_tokens_preempt_and_all_finish(tiny_model_dir) -> None:
    """Three requests without max_tokens on a pool of two contexts: all end by length at max_context, each
    as it does alone, and /metrics counts the preemptions (parsed with prometheus-client's parser)."""
    from concurrent.futures import ThreadPoolExecutor

    from prometheus_client.parser import text_string_to_metric_families

    msgs = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(3)]
    flags = dict(kv_capacity=256, max_context=128, prefill_chunk=32, page_size=16, max_concurrency=3)

    def ask(srv, m):
        r = srv.client().chat.completions.create(
            model=MODEL_NAME, messages=m, temperature=0, extra_body={"ignore_eos": True}
        )
        return (
            r.choices[0].finish_reason,
            r.usage.prompt_tokens + r.usage.completion_tokens,
            r.choices[0].message,
        )

    with live_server(tiny_model_dir, **flags) as srv:
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda m: ask(srv, m), msgs))
        _, _, body = srv.request("GET", "/metrics")
        metrics = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    with live_server(tiny_model_dir, **(flags | {"kv_capacity": 384})) as roomy:
        want = [ask(roomy, m) for m in msgs]
    assert got == want
    assert all(reason == "length" and total == 128 for reason, total, _ in got)
    assert metrics["nextserve_preemptions_total"] >= 1
    assert metrics["nextserve_preempted_resumes_total"] == metrics["nextserve_preemptions_total"]
    assert metrics["nextserve_preempted_sequences"] == 0
