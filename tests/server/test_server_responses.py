"""The OpenAI Responses API end to end (issue 20): a live server driven by the official `openai` client:
plain and streamed (the stream helper checks the events' order and identities), a two-step tool round trip,
previous_response_id over stored responses, GET / DELETE, input_tokens, the reasoning split, the same prompt
ids as the chat and Messages routes, stored responses private to their tenant, and bad input answered in
OpenAI's error shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from live_server import MODEL_NAME, assert_pool_full, live_server
from test_reasoning import THINKING
from tool_cases import CHAT_WEATHER, MESSAGES_WEATHER, RESPONSES_WEATHER

WEATHER = RESPONSES_WEATHER
GREEDY = {"temperature": 0}
ASK = "Say something about the sea."


def test_plain_and_streamed_answers_agree(server) -> None:
    c = server.client()
    resp = c.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=12, extra_body=GREEDY)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status in ("completed", "incomplete") and resp.output_text
    assert [i.type for i in resp.output] == ["message"] and resp.output[0].role == "assistant"
    assert resp.usage.output_tokens <= 12 and resp.usage.input_tokens > 0
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens"
    # NOTE: the SDK's stream helper returns a final response only after response.completed; an answer cut
    # at max_output_tokens ends with response.incomplete, whose response is the final one
    events = list(c.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=12, stream=True,
                                     extra_body=GREEDY))  # fmt: skip
    kinds = [e.type for e in events]
    final = events[-1].response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{resp.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    order = [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
    ]  # fmt: skip
    assert [k for k in kinds if k in order] == [k for k in order for _ in range(kinds.count(k))]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == resp.output_text
    assert final.output_text == resp.output_text and final.status == resp.status
    assert final.usage.output_tokens == resp.usage.output_tokens
    assert_pool_full(server.wait_idle())


def test_tool_round_trip_with_previous_response_id(server) -> None:
    """A required call whose arguments fit the schema; its output sent back by previous_response_id or as
    the whole conversation in input items renders the same prompt; the call streams as argument deltas."""
    c = server.client()
    ask = dict(model=MODEL_NAME, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
               parallel_tool_calls=False, max_output_tokens=256, extra_body=GREEDY)  # fmt: skip
    first = c.responses.create(**ask)
    (call,) = [i for i in first.output if i.type == "function_call"]
    args = json.loads(call.arguments)
    assert (
        call.name == "get_weather" and args["city"] in ("Paris", "Oslo") and isinstance(args["metric"], bool)
    )
    assert call.call_id and first.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "cold"}
    second = c.responses.create(
        model=MODEL_NAME,
        previous_response_id=first.id,
        input=[result],
        tools=[WEATHER],
        max_output_tokens=8,
        extra_body=GREEDY,
    )
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    whole = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        result,
    ]
    chained = c.responses.input_tokens.count(
        model=MODEL_NAME, previous_response_id=first.id, input=[result], tools=[WEATHER]
    ).input_tokens
    assert (
        chained == c.responses.input_tokens.count(model=MODEL_NAME, input=whole, tools=[WEATHER]).input_tokens
    )
    assert second.usage.input_tokens == chained and second.usage.input_tokens_details.cached_tokens >= 0
    with c.responses.stream(**ask) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_response()
    assert (
        "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    )
    (scall,) = [i for i in streamed.output if i.type == "function_call"]
    assert (scall.name, scall.arguments) == (call.name, call.arguments)
    assert_pool_full(server.wait_idle())


def test_stored_responses_get_delete_and_store_false(server) -> None:
    c = server.client()
    resp = c.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=4, extra_body=GREEDY)
    got = c.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text
    r = httpx.delete(f"{server.base_url}/responses/{resp.id}", timeout=30)
    assert r.status_code == 200 and r.json() == {"id": resp.id, "object": "response", "deleted": True}
    for call in (lambda: c.responses.retrieve(resp.id), lambda: c.responses.delete(resp.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model=MODEL_NAME, previous_response_id=resp.id, input="more", max_output_tokens=2)
    assert e.value.body["param"] == "id" or "resp_" in e.value.body["message"]
    unstored = c.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


def test_stored_responses_are_private_to_their_tenant(tiny_model_dir) -> None:
    with live_server(tiny_model_dir, api_key=("key-a", "key-b")) as srv:
        a = openai.OpenAI(base_url=srv.base_url, api_key="key-a", max_retries=0)
        b = openai.OpenAI(base_url=srv.base_url, api_key="key-b", max_retries=0)
        resp = a.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=2)
        assert a.responses.retrieve(resp.id).id == resp.id
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(resp.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(
                model=MODEL_NAME, previous_response_id=resp.id, input="more", max_output_tokens=2
            )
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(resp.id)
        assert a.responses.retrieve(resp.id).id == resp.id  # b's delete did not touch it


def test_reasoning_comes_back_as_a_reasoning_item(server) -> None:
    c = server.client()
    body = {"guided_regex": THINKING, "temperature": 0}
    chat = (
        c.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=40, extra_body=body
        )
        .choices[0]
        .message
    )
    resp = c.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=40, extra_body=body)
    assert [i.type for i in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == chat.reasoning_content and resp.output_text == chat.content
    assert resp.usage.output_tokens_details.reasoning_tokens > 0
    with c.responses.stream(model=MODEL_NAME, input="hi", max_output_tokens=40, extra_body=body) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert (
        streamed.output[0].content[0].text == chat.reasoning_content and streamed.output_text == chat.content
    )
    # the reasoning item sent back renders as the chat route renders reasoning_content
    back = [
        {"role": "user", "content": "hi"},
        resp.output[0].model_dump(),
        resp.output[1].model_dump(),
        {"role": "user", "content": "and?"},
    ]
    n = c.responses.input_tokens.count(model=MODEL_NAME, input=back).input_tokens
    chained = c.responses.input_tokens.count(model=MODEL_NAME, previous_response_id=resp.id, input="and?")
    assert chained.input_tokens == n


def test_one_conversation_gives_the_same_prompt_ids_through_every_dialect(server, monkeypatch) -> None:
    """chat, Messages and Responses render one conversation (system, a user turn, an assistant call, its
    result, a user turn) to the very same prompt token ids."""
    seen: list[list[int]] = []
    engine = server.state.engine
    add = engine.add_request
    monkeypatch.setattr(
        engine, "add_request", lambda ids, *a, **k: seen.append(list(ids)) or add(ids, *a, **k)
    )
    system, args = "You are a careful coding agent.", json.dumps({"city": "Oslo", "metric": True})
    server.client().chat.completions.create(
        model=MODEL_NAME,
        max_tokens=1,
        tools=[CHAT_WEATHER],
        messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": "What is the weather in Oslo?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": args},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
            {"role": "user", "content": "And tomorrow?"},
        ],
    )
    a = anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"), api_key="none", max_retries=0)
    a.messages.create(
        model=MODEL_NAME,
        max_tokens=1,
        system=system,
        tools=[MESSAGES_WEATHER],
        messages=[
            {"role": "user", "content": "What is the weather in Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": json.loads(args)}
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "cold"},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    )
    server.client().responses.create(
        model=MODEL_NAME,
        max_output_tokens=1,
        instructions=system,
        tools=[WEATHER],
        input=[
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
            {"type": "function_call_output", "call_id": "call_1", "output": "cold"},
            {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
        ],
    )
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2], [len(s) for s in seen]


def _post(srv, path: str, body) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=30)


GOOD = {"model": MODEL_NAME, "input": ASK, "max_output_tokens": 4}
BAD = [
    ({"model": MODEL_NAME}, "input"),
    (GOOD | {"input": []}, "input"),
    (GOOD | {"input": 5}, "input"),
    (GOOD | {"input": [{"role": "robot", "content": "x"}]}, "input"),
    (GOOD | {"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
    (GOOD | {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "image"),
    (GOOD | {"input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
    (GOOD | {"max_output_tokens": 0}, "max_output_tokens"),
    (GOOD | {"max_output_tokens": "4"}, "max_output_tokens"),
    (GOOD | {"temperature": 3}, "temperature"),
    (GOOD | {"top_p": 0}, "top_p"),
    (GOOD | {"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "web_search"),
    (GOOD | {"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto"}}, "allowed"),
    (GOOD | {"tools": [WEATHER, WEATHER]}, "also the function"),
    (
        GOOD | {"tools": [{"type": "namespace", "name": "ns", "tools": [WEATHER]}, WEATHER]},
        "also the function",
    ),
    (GOOD | {"tools": [WEATHER | {"colour": "red"}]}, "colour"),
    (GOOD | {"tools": [{"type": "namespace", "name": "ns"}]}, "tools"),
    (GOOD | {"tools": [{"type": "function"}]}, "name"),
    (GOOD | {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    (GOOD | {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    (GOOD | {"text": {"format": {"type": "yaml"}}}, "format"),
    (GOOD | {"text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
    (GOOD | {"reasoning": {"effort": "maximal"}}, "effort"),
    (GOOD | {"background": True}, "background"),
    (GOOD | {"conversation": "conv_1"}, "conversation"),
    (GOOD | {"store": "yes"}, "store"),
    (GOOD | {"top_logprobs": 3}, "top_logprobs"),
    (GOOD | {"input": [{"role": "user", "content": [{"type": "input_video", "video": "x"}]}]}, "input"),
    (GOOD | {"cache_salt": ""}, "cache_salt"),
]


@pytest.mark.parametrize("body,word", BAD, ids=[w + str(i) for i, (_, w) in enumerate(BAD)])
def test_bad_input_in_openais_error_shape(server, body, word) -> None:
    r = _post(server, "/responses", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and word in err["message"] + str(err.get("param")), err
    r = _post(server, "/responses/input_tokens", {k: v for k, v in body.items() if k in InputFields})
    assert r.status_code in (200, 400)


InputFields = {
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "tools",
    "tool_choice",
    "text",
    "reasoning",
    "parallel_tool_calls",
    "truncation",
    "conversation",
}


def test_unknown_previous_response_is_a_404(server) -> None:
    r = _post(server, "/responses", GOOD | {"previous_response_id": "resp_nothing"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.base_url + "/responses/resp_nothing", timeout=30)
    assert r.status_code == 404 and "resp_nothing" in r.json()["error"]["message"]
