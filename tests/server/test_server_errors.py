"""Bad requests, table-driven: every field gets its wrong values, and each gets the right status in
OpenAI's error shape, touches no pages or slots, and leaves the server answering."""

from __future__ import annotations

import json

import pytest
from live_server import MODEL_NAME, assert_pool_full, live_server

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
USAGE = {"include_usage": True}  # stream_options


def chat(**fields):
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 4} | fields


def comp(**fields):
    return {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4} | fields


LONG = "word " * 1500  # far more than max_context (1024) tokens

# (id, path, body; a bytes body is sent as it is, expected status, expected `param` (None: not checked))
CASES: list[tuple[str, str, object, int, str | None]] = [
    # the body itself
    ("not-json", CHAT, b"{not json", 400, None),
    ("json-array", CHAT, b"[1, 2]", 400, None),
    ("empty-body", CHAT, b"", 400, None),
    ("deep-nesting", CHAT, b'{"messages": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None),
    ("bad-utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    (
        "nan",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        400,
        "temperature",
    ),
    # model
    ("model-unknown", CHAT, chat(model="gpt-17"), 404, "model"),
    ("model-int", CHAT, chat(model=5), 400, "model"),
    # messages
    ("messages-missing", CHAT, {"model": MODEL_NAME}, 400, "messages"),
    ("messages-string", CHAT, chat(messages="hi"), 400, "messages"),
    ("messages-empty", CHAT, chat(messages=[]), 400, "messages"),
    ("message-not-object", CHAT, chat(messages=["hi"]), 400, "messages.0"),
    ("role-unknown", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    ("role-missing", CHAT, chat(messages=[{"content": "x"}]), 400, "messages.0.role"),
    ("role-function", CHAT, chat(messages=[{"role": "function", "content": "x", "name": "f"}]), 400, None),
    ("content-int", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, None),
    ("content-null-user", CHAT, chat(messages=[{"role": "user", "content": None}]), 400, None),
    (
        "content-image",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages.0.content.0",  # the part itself (union-member tags are skipped, not where the path ends)
    ),
    (
        "content-part-no-text",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        400,
        None,
    ),
    (
        "tool-calls-on-user",
        CHAT,
        chat(
            messages=[
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [{"type": "function", "function": {"name": "f"}}],
                }
            ]
        ),
        400,
        None,
    ),
    (
        "tool-call-bad-type",
        CHAT,
        chat(
            messages=[{"role": "assistant", "tool_calls": [{"type": "retrieval", "function": {"name": "f"}}]}]
        ),
        400,
        None,
    ),
    ("prompt-too-long", CHAT, chat(messages=[{"role": "user", "content": LONG}]), 400, "messages"),
    # max_tokens / max_completion_tokens
    ("max-tokens-string", CHAT, chat(max_tokens="10"), 400, "max_tokens"),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    ("max-tokens-float", CHAT, chat(max_tokens=1.5), 400, "max_tokens"),
    ("max-tokens-bool", CHAT, chat(max_tokens=True), 400, "max_tokens"),
    ("max-tokens-cannot-fit", CHAT, chat(max_tokens=1024), 400, "max_tokens"),
    ("max-tokens-huge", CHAT, chat(max_tokens=10**12), 400, "max_tokens"),
    ("max-completion-tokens-zero", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("max-completion-tokens-cannot-fit", CHAT, chat(max_completion_tokens=5000), 400, "max_tokens"),
    # sampling
    ("temperature-string", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("temperature-negative", CHAT, chat(temperature=-0.1), 400, "temperature"),
    ("temperature-too-big", CHAT, chat(temperature=2.5), 400, "temperature"),
    ("temperature-bool", CHAT, chat(temperature=True), 400, "temperature"),
    ("top-p-zero", CHAT, chat(top_p=0), 400, "top_p"),
    ("top-p-big", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("top-p-string", CHAT, chat(top_p="x"), 400, "top_p"),
    ("top-k-below", CHAT, chat(top_k=-2), 400, "top_k"),
    ("top-k-float", CHAT, chat(top_k=1.5), 400, "top_k"),
    ("seed-string", CHAT, chat(seed="x"), 400, "seed"),
    ("seed-float", CHAT, chat(seed=1.5), 400, "seed"),
    ("seed-huge", CHAT, chat(seed=2**70), 400, "seed"),
    ("seed-very-negative", CHAT, chat(seed=-(2**64)), 400, "seed"),
    ("stop-int", CHAT, chat(stop=5), 400, "stop"),
    ("stop-list-int", CHAT, chat(stop=[1]), 400, None),
    ("stop-empty-string", CHAT, chat(stop=""), 400, "stop"),
    ("stop-empty-in-list", CHAT, chat(stop=["a", ""]), 400, "stop"),
    ("stop-too-many", CHAT, chat(stop=[str(i) for i in range(17)]), 400, "stop"),
    ("stop-token-ids-negative", CHAT, chat(stop_token_ids=[-1]), 400, None),
    ("stop-token-ids-out-of-vocab", CHAT, chat(stop_token_ids=[10**6]), 400, "stop_token_ids"),
    ("n-zero", CHAT, chat(n=0), 400, "n"),
    ("n-string", CHAT, chat(n="1"), 400, "n"),
    ("n-float", CHAT, chat(n=2.0), 400, "n"),
    ("n-129", CHAT, chat(n=129), 400, "n"),
    ("n-beyond-max-pending", CHAT, chat(n=65), 400, "n"),  # the test server's --max-pending is 64
    ("presence-penalty-range", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    ("presence-penalty-low", CHAT, chat(presence_penalty=-2.01), 400, "presence_penalty"),
    (
        "presence-penalty-nan",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": NaN}',
        400,
        "presence_penalty",
    ),
    ("frequency-penalty-string", CHAT, chat(frequency_penalty="x"), 400, "frequency_penalty"),
    ("frequency-penalty-range", CHAT, chat(frequency_penalty=2.5), 400, "frequency_penalty"),
    ("repetition-penalty-zero", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("repetition-penalty-range", CHAT, chat(repetition_penalty=2.01), 400, "repetition_penalty"),
    ("repetition-penalty-string", CHAT, chat(repetition_penalty="1"), 400, "repetition_penalty"),
    ("min-p-range", CHAT, chat(min_p=1.5), 400, "min_p"),
    ("min-p-negative", CHAT, chat(min_p=-0.1), 400, "min_p"),
    ("min-p-string", CHAT, chat(min_p="0.1"), 400, "min_p"),
    ("logit-bias-string", CHAT, chat(logit_bias="x"), 400, "logit_bias"),
    ("logit-bias-key", CHAT, chat(logit_bias={"x": 5}), 400, "logit_bias"),
    ("logit-bias-negative-key", CHAT, chat(logit_bias={"-1": 5}), 400, "logit_bias"),
    ("logit-bias-beyond-vocab", CHAT, chat(logit_bias={"512": 5}), 400, "logit_bias"),  # vocab 512
    ("logit-bias-value", CHAT, chat(logit_bias={"1": 101}), 400, "logit_bias.1"),
    ("logit-bias-value-string", CHAT, chat(logit_bias={"1": "5"}), 400, "logit_bias.1"),
    ("logit-bias-too-many", CHAT, chat(logit_bias={str(i): 1 for i in range(1025)}), 400, "logit_bias"),
    # streaming
    ("stream-string", CHAT, chat(stream="yes"), 400, "stream"),
    ("stream-int", CHAT, chat(stream=1), 400, "stream"),
    ("stream-options-without-stream", CHAT, chat(stream_options=USAGE), 400, "stream_options"),
    ("stream-options-bad", CHAT, chat(stream=True, stream_options={"include_usage": "x"}), 400, None),
    ("stream-options-string", CHAT, chat(stream=True, stream_options="x"), 400, None),
    # logprobs
    ("logprobs-string", CHAT, chat(logprobs="x"), 400, "logprobs"),
    ("logprobs-int", CHAT, chat(logprobs=1), 400, "logprobs"),
    ("top-logprobs-big", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top-logprobs-negative", CHAT, chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    # tools
    ("tools-string", CHAT, chat(tools="x"), 400, "tools"),
    ("tools-not-function", CHAT, chat(tools=[{"type": "retrieval"}]), 400, None),
    ("tools-no-function", CHAT, chat(tools=[{"type": "function"}]), 400, None),
    ("tools-no-name", CHAT, chat(tools=[{"type": "function", "function": {"parameters": {}}}]), 400, None),
    (
        "tools-bad-name",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
        400,
        None,
    ),
    (
        "tools-params-string",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
        400,
        None,
    ),
    (
        "tools-params-bad-schema",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]),
        400,
        None,
    ),
    ("tools-duplicate", CHAT, chat(tools=[TOOL, TOOL]), 400, "tools"),
    ("tool-choice-unknown", CHAT, chat(tools=[TOOL], tool_choice="sometimes"), 400, None),
    ("tool-choice-int", CHAT, chat(tools=[TOOL], tool_choice=5), 400, None),
    (
        "tool-choice-named-missing",
        CHAT,
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
        "tool_choice",
    ),
    ("tool-choice-required-no-tools", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    (
        "tool-choice-and-response-format",
        CHAT,
        chat(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}),
        400,
        None,
    ),
    # structured output
    ("response-format-unknown", CHAT, chat(response_format={"type": "xml"}), 400, None),
    ("response-format-string", CHAT, chat(response_format="json"), 400, None),
    ("response-format-no-schema", CHAT, chat(response_format={"type": "json_schema"}), 400, None),
    (
        "response-format-bad-schema",
        CHAT,
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
        ),
        400,
        None,
    ),
    ("guided-regex-bad", CHAT, chat(guided_regex="(("), 400, "guided_regex"),
    ("guided-regex-int", CHAT, chat(guided_regex=5), 400, "guided_regex"),
    ("guided-grammar-bad", CHAT, chat(guided_grammar="root ::= "), 400, "guided_grammar"),
    ("guided-choice-empty", CHAT, chat(guided_choice=[]), 400, "guided_choice"),
    ("guided-json-not-json", CHAT, chat(guided_json="{x"), 400, "guided_json"),
    ("two-constraints", CHAT, chat(guided_regex="a+", response_format={"type": "json_object"}), 400, None),
    ("structured-outputs-two", CHAT, chat(structured_outputs={"regex": "a", "choice": ["b"]}), 400, None),
    ("chat-template-kwargs-string", CHAT, chat(chat_template_kwargs="x"), 400, None),
    ("chat-template-kwargs-list", CHAT, chat(chat_template_kwargs=["x"]), 400, None),
    ("add-generation-prompt-string", CHAT, chat(add_generation_prompt="yes"), 400, "add_generation_prompt"),
    (
        "parallel-tool-calls-string",
        CHAT,
        chat(tools=[TOOL], parallel_tool_calls="x"),
        400,
        "parallel_tool_calls",
    ),
    ("ignore-eos-string", CHAT, chat(ignore_eos="yes"), 400, "ignore_eos"),
    ("user-int", CHAT, chat(user=5), 400, "user"),
    ("stop-token-ids-string", CHAT, chat(stop_token_ids="x"), 400, "stop_token_ids"),
    ("guided-choice-string", CHAT, chat(guided_choice="a"), 400, "guided_choice"),
    ("guided-grammar-int", CHAT, chat(guided_grammar=5), 400, "guided_grammar"),
    ("structured-outputs-regex-int", CHAT, chat(structured_outputs={"regex": 5}), 400, None),
    (
        "continuous-usage-stats-string",
        CHAT,
        chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": "x"}),
        400,
        None,
    ),
    ("message-name-int", CHAT, chat(messages=[{"role": "user", "content": "x", "name": 5}]), 400, None),
    (
        "reasoning-content-int",
        CHAT,
        chat(messages=[*USER, {"role": "assistant", "content": "x", "reasoning_content": 5}, *USER]),
        400,
        None,
    ),
    (
        "tool-call-id-int",
        CHAT,
        chat(messages=[*USER, {"role": "tool", "content": "x", "tool_call_id": 5}]),
        400,
        None,
    ),
    (
        "tools-description-int",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "description": 5}}]),
        400,
        None,
    ),
    (
        "tools-strict-string",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "strict": "x"}}]),
        400,
        None,
    ),
    # completions
    ("prompt-missing", COMP, {"model": MODEL_NAME}, 400, "prompt"),
    ("prompt-int", COMP, comp(prompt=5), 400, None),
    ("prompt-empty-list", COMP, comp(prompt=[]), 400, "prompt"),
    ("prompt-empty-string", COMP, comp(prompt=""), 400, "prompt"),
    ("prompt-batch", COMP, comp(prompt=["a", "b"]), 400, "prompt"),
    ("prompt-batch-ids", COMP, comp(prompt=[[1], [2]]), 400, "prompt"),
    ("prompt-negative-id", COMP, comp(prompt=[-1]), 400, "prompt"),
    ("prompt-id-out-of-vocab", COMP, comp(prompt=[10**6]), 400, "prompt"),
    ("prompt-float-ids", COMP, comp(prompt=[1.5]), 400, None),
    ("prompt-too-long", COMP, comp(prompt=LONG), 400, "prompt"),
    ("comp-max-tokens-zero", COMP, comp(max_tokens=0), 400, "max_tokens"),
    ("comp-max-tokens-cannot-fit", COMP, comp(max_tokens=1024), 400, "max_tokens"),
    ("comp-logprobs-big", COMP, comp(logprobs=21), 400, "logprobs"),
    ("comp-logprobs-bool", COMP, comp(logprobs=True), 400, "logprobs"),
    ("comp-best-of", COMP, comp(best_of=2), 400, "best_of"),
    ("comp-suffix", COMP, comp(suffix="x"), 400, "suffix"),
    ("comp-echo-logprobs", COMP, comp(echo=True, logprobs=1), 400, "echo"),
    ("comp-echo-string", COMP, comp(echo="yes"), 400, "echo"),
    ("comp-n-zero", COMP, comp(n=0), 400, "n"),
    ("comp-stream-options-without-stream", COMP, comp(stream_options=USAGE), 400, "stream_options"),
    ("comp-model-unknown", COMP, comp(model="nope"), 404, "model"),
    ("comp-echo-int", COMP, comp(echo=1), 400, "echo"),
    ("comp-ignore-eos-string", COMP, comp(ignore_eos="x"), 400, "ignore_eos"),
    ("comp-temperature-string", COMP, comp(temperature="x"), 400, "temperature"),
    ("comp-stop-int", COMP, comp(stop=5), 400, "stop"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_request(server, path, body, status, param):
    raw = body if isinstance(body, bytes) else None
    got, headers, data = server.request("POST", path, body=None if raw is not None else body, raw=raw)
    assert got == status, data
    assert headers["content-type"].startswith("application/json")
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/nothing", 404),
        ("POST", "/nothing", 404),
        ("GET", "/v1/models/unknown-model", 404),
        ("POST", "/v1/models", 405),
        ("GET", "/v1/chat/completions", 405),
        ("DELETE", "/v1/completions", 405),
    ],
)
def test_bad_routes(server, method, path, status):
    got, _, data = server.request(method, path)
    assert got == status
    assert set(json.loads(data)["error"]) == {"message", "type", "param", "code"}


def test_server_unharmed_by_bad_requests(server):
    assert_pool_full(server.wait_idle())
    r = server.client().chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")
    status, _, _ = server.request("GET", "/health")
    assert status == 200


def test_api_key(tiny_model_dir):
    with live_server(
        tiny_model_dir, api_key="sekret", max_concurrency=1, kv_capacity=512, max_context=256
    ) as srv:
        body = chat()
        for headers in (
            {"Authorization": ""},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "sekret"},
        ):
            status, h, data = srv.request("POST", CHAT, body=body, headers=headers)
            assert status == 401, headers
            assert json.loads(data)["error"]["code"] == "invalid_api_key"
        status, _, _ = srv.request("GET", "/v1/models", headers={"Authorization": "Bearer nope"})
        assert status == 401
        # Unprotected: health and metrics. Protected with the right key: everything.
        assert srv.request("GET", "/health", headers={"Authorization": ""})[0] == 200
        assert srv.request("GET", "/metrics", headers={"Authorization": ""})[0] == 200
        assert srv.request("POST", CHAT, body=body)[0] == 200
        import openai

        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.base_url, api_key="wrong").models.list()
        assert srv.client().models.list().data[0].id == MODEL_NAME
