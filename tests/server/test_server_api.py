"""The OpenAI API end to end: a live server driven by the official `openai` client."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from live_server import MODEL_NAME, assert_pool_full
from tool_cases import CHAT_WEATHER

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]

WEATHER = CHAT_WEATHER
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"x": {"enum": [1, 2, 3]}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
}


def test_models_health_metrics(server):
    client = server.client()
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    status, _, body = server.request("GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, _, body = server.request("GET", "/openapi.json")
    assert status == 200 and "/v1/chat/completions" in json.loads(body)["paths"]
    client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=3)
    status, headers, body = server.request("GET", "/metrics")
    text = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in (
        'nextserve_requests_total{endpoint="/v1/chat/completions",status="200"}',
        "nextserve_prompt_tokens_total",
        "nextserve_generation_tokens_total",
        "nextserve_cached_prompt_tokens_total",
        "nextserve_time_to_first_token_seconds_bucket",
        "nextserve_inter_token_latency_seconds_bucket",
        "nextserve_queue_depth",
        "nextserve_running_sequences",
        "nextserve_kv_pages_in_use",
        "nextserve_spec_draft_tokens_total",
        "nextserve_spec_accepted_tokens_total",
        "nextserve_preemptions_total",
        "nextserve_preempted_resumes_total",
        "nextserve_prefix_cache_hits_total",
        "nextserve_prefix_cache_misses_total",
        "nextserve_expert_cache_hits_total",  # (0 without a cache)
        "nextserve_expert_cache_link_bytes_total",
        "nextserve_preempted_sequences",
        "nextserve_prefix_images",
    ):
        assert name in text, name
    assert "nextserve_gpu_energy_joules" not in text  # NVML's counter exists on a GPU only


def test_chat_usage_and_shape(server):
    r = server.client().chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=12, seed=1)
    assert r.object == "chat.completion" and r.model == MODEL_NAME and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str)
    u = r.usage
    assert 0 < u.completion_tokens <= 12 and u.prompt_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    if choice.finish_reason == "length":
        assert u.completion_tokens == 12


def test_stream_matches_non_stream(server):
    client = server.client()
    kw = dict(model=MODEL_NAME, messages=MSGS, max_tokens=24, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finishes == [full.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_seeded_sampling_reproduces(server):
    client = server.client()
    kw = dict(model=MODEL_NAME, messages=MSGS, max_tokens=16, temperature=1.0, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_logprobs(server):
    r = server.client().chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = r.choices[0]
    items = choice.logprobs.content
    expected = r.usage.completion_tokens - (1 if choice.finish_reason == "stop" else 0)
    assert len(items) == expected
    for item in items:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token
        # Greedy: the chosen token is the most likely one.
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert [t.logprob for t in item.top_logprobs] == sorted(
            (t.logprob for t in item.top_logprobs), reverse=True
        )
    stream = server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=MSGS,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [
        lp for c in stream if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content
    ]
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in items]


def test_completions(server):
    client = server.client()
    r = client.completions.create(
        model=MODEL_NAME, prompt="def main():", max_tokens=6, temperature=0, logprobs=2
    )
    (choice,) = r.choices
    assert r.object == "text_completion" and choice.finish_reason in ("stop", "length")
    assert (
        len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == len(choice.logprobs.text_offset)
    )
    assert all(len(t) <= 2 for t in choice.logprobs.top_logprobs)
    # Token ids, echo, and streaming give the same tokens.
    ids = server.engine.engine.tokenizer.encode("def main():", add_special_tokens=False)
    r2 = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert r2.choices[0].text == "def main():" + choice.text
    assert r2.usage.prompt_tokens == len(ids) == r.usage.prompt_tokens
    parts = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt="def main():",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(p.choices[0].text for p in parts if p.choices) == choice.text
    assert parts[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_strings(server):
    client = server.client()
    kw = dict(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=40, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = next((full[i : i + 3] for i in range(4, len(full) - 3) if full[i : i + 3].strip()), None)
    if stop is None:
        pytest.skip("the random model gave too little text to cut")
    cut = full[: full.find(stop)]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **kw))
    assert streamed == cut


def test_json_schema_answer_validates(server):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
        "required": ["answer", "color"],
        "additionalProperties": False,
    }
    client = server.client()
    stopped = 0
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MSGS,
            max_tokens=120,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        )
        choice = r.choices[0]
        if choice.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(choice.message.content), schema)
    assert stopped >= 1


def test_json_object_regex_choice(server):
    client = server.client()
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_tokens=120, seed=3, response_format={"type": "json_object"}
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(
        model=MODEL_NAME,
        prompt="id:",
        max_tokens=20,
        seed=0,
        extra_body={"guided_regex": r"[0-9]{3}-(ab|cd)"},
    )
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-(ab|cd)", r.choices[0].text)
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_tokens=20, extra_body={"guided_choice": ["yes", "no way"]}
    )
    assert r.choices[0].message.content in ("yes", "no way")
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MSGS,
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": "[a-c]{4}"}},
    )
    assert re.fullmatch("[a-c]{4}", r.choices[0].message.content)


def _stream_tool_calls(stream) -> tuple[str, dict[int, dict], str | None]:
    content, calls, finish = "", {}, None
    for c in stream:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                entry["id"] = tc.id
            if tc.function and tc.function.name:
                entry["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
        finish = c.choices[0].finish_reason or finish
    return content, calls, finish


def test_named_tool_choice(server):
    client = server.client()
    kw = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=150,
        seed=5,
    )
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.tool_calls and msg.tool_calls[0].function.name == "get_weather"
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].id.startswith("call_")
    if r.choices[0].finish_reason == "tool_calls":
        jsonschema.validate(
            json.loads(msg.tool_calls[0].function.arguments), WEATHER["function"]["parameters"]
        )
    # Streamed: the same call, sent as a name then argument fragments.
    content, calls, finish = _stream_tool_calls(client.chat.completions.create(stream=True, **kw))
    assert finish == r.choices[0].finish_reason and not content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (tc.function.name, tc.function.arguments) for tc in msg.tool_calls
    ]


def test_required_tool_choice_several_calls(server):
    client = server.client()
    for seed in range(6):
        kw = dict(
            model=MODEL_NAME,
            messages=MSGS,
            tools=[WEATHER, ADD],
            tool_choice="required",
            max_tokens=200,
            seed=seed,
        )
        r = client.chat.completions.create(**kw)
        calls = r.choices[0].message.tool_calls
        assert calls and all(c.function.name in ("get_weather", "add") for c in calls)
        if r.choices[0].finish_reason == "tool_calls" and len(calls) > 1:
            break
    else:
        pytest.skip("no seed gave several complete calls")
    tools = {"get_weather": WEATHER, "add": ADD}
    for c in calls:
        jsonschema.validate(
            json.loads(c.function.arguments), tools[c.function.name]["function"]["parameters"]
        )
    assert len({c.id for c in calls}) == len(calls)
    _, streamed, finish = _stream_tool_calls(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_tool_choice_auto_and_none(server):
    client = server.client()
    auto = client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, tools=[WEATHER], max_tokens=10, seed=0
    )
    none = client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, tools=[WEATHER], tool_choice="none", max_tokens=10, seed=0
    )
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # With tool_choice none the tools stay out of the prompt.
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens
    assert not none.choices[0].message.tool_calls


def test_conversation_with_tool_results(server):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "metric": true}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
        {"role": "developer", "content": "Answer briefly."},
    ]
    r = server.client().chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=[WEATHER], max_tokens=5
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_pool_is_full_after_the_api_tests(server):
    assert_pool_full(server.wait_idle())


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a \\u0000 b"}], "max_tokens": 2}',
        ),
        ("/v1/completions", b'{"prompt": "\\ud83d\\ude00 a pair is text", "max_tokens": 2}'),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "{{ raise_exception(\'x\') }}"}], "max_tokens": 2}',
        ),
    ],
)
def test_odd_text_is_served(server, path, raw):
    status, _, body = server.request("POST", path, raw=raw)
    assert status == 200, body
