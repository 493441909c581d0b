"""Prefix reuse through the chat API: an agent's next turn and a rewritten last message resume from
stored images (usage.prompt_tokens_details.cached_tokens), with the answer a cold server gives."""

from __future__ import annotations

import pytest
from live_server import live_server

SYSTEM = "You are a careful coding agent. " * 12
HISTORY = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Write a function that reverses a list, with a docstring and tests."},
    {"role": "assistant", "content": "def rev(xs):\n    return xs[::-1]\n" * 4},
]


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    flags = dict(prefill_chunk=32)
    with live_server(tiny_model_dir, prefix_cache_images=16, **flags) as warm:
        with live_server(tiny_model_dir, **flags) as cold:
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
