"""The Anthropic Messages API end to end (issue 20): a live server driven by the official `anthropic`
client: plain, streamed, a two-step tool round trip, stop sequences, count_tokens, the same prompt tokens as
the chat route, x-api-key, and bad input answered in the dialect's own error shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from live_server import MODEL_NAME, assert_pool_full, live_server
from tool_cases import CHAT_WEATHER, MESSAGES_WEATHER

WEATHER = MESSAGES_WEATHER
USER = [{"role": "user", "content": "Say something about the sea."}]
GREEDY = {"temperature": 0}  # (the client's create() takes no sampling arguments: sent as extra body)
WEATHER_FN = CHAT_WEATHER


def client(srv, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base_url.removesuffix("/v1"), api_key=key, max_retries=0)


def test_plain_and_streamed_answers_agree(server) -> None:
    c = client(server)
    msg = c.messages.create(model=MODEL_NAME, max_tokens=12, messages=USER, extra_body=GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens <= 12 and msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 0
    with c.messages.stream(model=MODEL_NAME, max_tokens=12, messages=USER, extra_body=GREEDY) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events and "message_delta" in events
    assert final.content[0].text == msg.content[0].text and final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens
    assert_pool_full(server.wait_idle())


def test_tool_round_trip(server) -> None:
    c = client(server)
    ask = dict(model=MODEL_NAME, max_tokens=256, messages=USER, tools=[WEATHER], tool_choice={"type": "any"},
               extra_body=GREEDY)  # fmt: skip
    first = c.messages.create(**ask)
    assert first.stop_reason == "tool_use"
    call, *_ = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Oslo") and call.id
    with c.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()

    def shown(blocks):  # the call ids are each answer's own
        return [b.model_dump(exclude={"id"}) for b in blocks]

    assert shown(streamed.content) == shown(first.content)
    follow = USER + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}],
        },
    ]
    second = c.messages.create(
        model=MODEL_NAME, max_tokens=8, messages=follow, tools=[WEATHER], extra_body=GREEDY
    )
    assert second.content and second.usage.cache_read_input_tokens >= 0
    assert_pool_full(server.wait_idle())


def test_max_tokens_past_the_context_is_cut_to_the_room_left(server) -> None:
    """Claude Code sends max_tokens 64,000 whatever the context: the answer runs to the context's end and
    stops there with stop_reason max_tokens (the chat route, OpenAI's semantics, still refuses it)."""
    body = GOOD | {"max_tokens": 64000, "ignore_eos": True, "temperature": 0}
    r = _post(server, "/messages", body)
    assert r.status_code == 200, r.text
    msg = r.json()
    used = (
        msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"] + msg["usage"]["output_tokens"]
    )
    assert msg["stop_reason"] == "max_tokens" and used == server.engine.config.max_context, msg["usage"]
    chat = {"model": MODEL_NAME, "messages": GOOD["messages"], "max_tokens": 64000}
    status, _, raw = server.request("POST", "/v1/chat/completions", chat)
    assert status == 400 and b"context" in raw


def test_stop_sequence_is_reported(server) -> None:
    c = client(server)
    text = (
        c.messages.create(model=MODEL_NAME, max_tokens=24, messages=USER, extra_body=GREEDY).content[0].text
    )
    stop = text[len(text) // 2 :][:3]
    assert stop.strip()
    msg = c.messages.create(
        model=MODEL_NAME, max_tokens=24, messages=USER, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert stop not in msg.content[0].text


def test_same_prompt_tokens_as_the_chat_route(server) -> None:
    """One conversation through /v1/messages and /v1/chat/completions renders to the same prompt; the
    billing-header line some clients put into the system prompt is left out."""
    c = client(server)
    system = "You are a careful coding agent."
    call_input = {"city": "Oslo", "metric": True}
    messages = [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": call_input}],
        },  # fmt: skip
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "cold"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },  # fmt: skip
    ]
    n = c.messages.count_tokens(
        model=MODEL_NAME, messages=messages, system=system, tools=[WEATHER]
    ).input_tokens
    billed = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0.1; cc_entrypoint=cli"},
              {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]  # fmt: skip
    assert (
        c.messages.count_tokens(
            model=MODEL_NAME, messages=messages, system=billed, tools=[WEATHER]
        ).input_tokens
        == n
    )
    chat = server.client().chat.completions.create(
        model=MODEL_NAME, max_tokens=1, messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(call_input)}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
            {"role": "user", "content": "And tomorrow?"},
        ],
        tools=[WEATHER_FN],
    )  # fmt: skip
    assert chat.usage.prompt_tokens == n
    msg = c.messages.create(model=MODEL_NAME, max_tokens=1, messages=messages, system=billed, tools=[WEATHER])
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == n
    assert msg.usage.cache_read_input_tokens > 0  # the chat request's prompt images serve this dialect too


def _post(srv, path: str, body, headers: dict | None = None) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, headers=headers or {}, timeout=30)


GOOD = {"model": MODEL_NAME, "max_tokens": 4, "messages": USER}
BAD = [
    ({k: v for k, v in GOOD.items() if k != "max_tokens"}, "max_tokens"),
    (GOOD | {"max_tokens": 0}, "max_tokens"),
    (GOOD | {"max_tokens": "4"}, "max_tokens"),
    (GOOD | {"messages": []}, "messages"),
    (GOOD | {"messages": [{"role": "tool", "content": "x"}]}, "role"),
    (
        GOOD
        | {
            "messages": [
                {"role": "system", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}
            ]
        },
        "system message",
    ),
    (GOOD | {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    (GOOD | {"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages"),
    (GOOD | {"temperature": 1.5}, "temperature"),
    (GOOD | {"top_p": 0}, "top_p"),
    (GOOD | {"top_k": -1}, "top_k"),
    (GOOD | {"stop_sequences": [""]}, "stop"),
    (GOOD | {"stop_sequences": "x"}, "stop_sequences"),
    (GOOD | {"tools": [{"name": "f"}]}, "input_schema"),
    (GOOD | {"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "name"),
    (GOOD | {"tool_choice": {"type": "tool"}}, "tool_choice"),
    (GOOD | {"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    (GOOD | {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    (GOOD | {"thinking": {"type": "maybe"}}, "thinking"),
    (
        GOOD | {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "colour": "red"}]}]},
        "colour",
    ),
    (GOOD | {"tools": [WEATHER | {"colour": "red"}]}, "colour"),
    (
        GOOD
        | {
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            "tool_choice": {"type": "tool", "name": "web_search"},
        },
        "server tool",
    ),
    (GOOD | {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    (GOOD | {"output_config": {"format": {"type": "json_schema"}}}, "schema"),
    (GOOD | {"thinking": {"type": "adaptive", "budget_tokens": -1}}, "budget_tokens"),
    (GOOD | {"cache_salt": ""}, "cache_salt"),
]


@pytest.mark.parametrize("body,word", BAD, ids=[w + str(i) for i, (_, w) in enumerate(BAD)])
def test_bad_input_in_the_dialects_error_shape(server, body, word) -> None:
    r = _post(server, "/messages", body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert word in err["error"]["message"], err


def test_errors_auth_and_unknown_model(tiny_model_dir) -> None:
    with live_server(tiny_model_dir, api_key="sekret") as srv:
        r = _post(srv, "/messages", GOOD)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = _post(srv, "/messages", GOOD, {"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["type"] == "error"
        ok = client(srv, "sekret").messages.create(**GOOD)  # x-api-key, as the client sends it
        assert ok.type == "message" and ok.usage.output_tokens >= 1
        with pytest.raises(anthropic.NotFoundError) as e:
            client(srv, "sekret").messages.create(**(GOOD | {"model": "other-model"}))
        assert e.value.body["error"]["type"] == "not_found_error"
        # Anthropic's clients name their own models (Claude Code: the main one and a small one)
        for name in ("claude-opus-4-8", "claude-haiku-4-5-20251001"):
            assert client(srv, "sekret").messages.create(**(GOOD | {"model": name})).type == "message"
        r = _post(srv, "/messages", "not an object", {"x-api-key": "sekret"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
