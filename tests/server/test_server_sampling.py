"""The sampling fields clients bring from vLLM: `n` (each choice its own seeded request), the penalties,
min_p and logit_bias, through the official client, whole and streamed."""

from __future__ import annotations

from live_server import MODEL_NAME, assert_pool_full

MSGS = [{"role": "user", "content": "Tell me about lists."}]


def test_n_choices_each_equal_their_request_alone(server):
    client = server.client()
    kw = dict(
        model=MODEL_NAME, messages=MSGS, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True}
    )
    many = client.chat.completions.create(n=3, seed=40, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(seed=40 + i, **kw).choices[0] for i in range(3)]
    assert [c.message.content for c in many.choices] == [c.message.content for c in alone]
    assert len({c.message.content for c in many.choices}) > 1  # different seeds, different samples
    one = client.chat.completions.create(n=1, seed=40, **kw)
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens == 36
    assert_pool_full(server.wait_idle())


def test_n_choices_streamed_equal_whole(server):
    client = server.client()
    kw = dict(model=MODEL_NAME, messages=MSGS, max_tokens=10, temperature=0.8, seed=7, n=2)
    whole = client.chat.completions.create(**kw)
    texts, roles, finishes = {0: "", 1: ""}, {}, {}
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.delta.role:
                roles[ch.index] = ch.delta.role
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert roles == {0: "assistant", 1: "assistant"} and set(finishes) == {0, 1}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_n(server):
    client = server.client()
    r = client.completions.create(model=MODEL_NAME, prompt="def f(", max_tokens=6, n=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text  # greedy


def test_penalties_min_p_and_logit_bias_are_applied(server):
    client = server.client()
    tok = server.engine.tokenizer
    forced = tok.encode(" x", add_special_tokens=False)[0]
    kw = dict(model=MODEL_NAME, messages=MSGS, max_tokens=64, temperature=0, logit_bias={str(forced): 60})
    body = {"ignore_eos": True}
    biased = client.chat.completions.create(extra_body=body, **kw).choices[0].message.content
    assert biased == tok.decode([forced] * 64)
    # the frequency penalty grows with every " x" until other tokens win (the model's logits are small)
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0, "frequency_penalty": 1.0}):
        penalized = client.chat.completions.create(extra_body=body, **kw, **extra).choices[0].message.content
        assert penalized != biased and penalized.startswith(tok.decode([forced] * 5))
    repeated = client.chat.completions.create(extra_body=body | {"repetition_penalty": 2.0}, **kw)
    assert repeated.choices[0].message.content == biased  # a bias of 60 outweighs halving its logit
    sampled = client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_tokens=8, temperature=1.0, seed=1, extra_body={"min_p": 0.2}
    )
    assert sampled.choices[0].finish_reason in ("stop", "length")
    assert_pool_full(server.wait_idle())


def test_generation_configs_max_new_tokens_is_the_default_max_tokens(tiny_model_dir, tmp_path):
    """As vLLM applies it: a request without max_tokens stops there; one that gives it is its own."""
    import json
    import shutil

    from live_server import live_server

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    gen = json.loads((model / "generation_config.json").read_text()) | {"max_new_tokens": 5}
    (model / "generation_config.json").write_text(json.dumps(gen))
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    with live_server(model) as srv:
        status, _, raw = srv.request("POST", "/v1/chat/completions", chat)
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 5, raw
        status, _, raw = srv.request("POST", "/v1/chat/completions", chat | {"max_tokens": 9})
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 9, raw
        status, _, raw = srv.request(
            "POST", "/v1/responses", {"model": MODEL_NAME, "input": "hi", "ignore_eos": True}
        )
        assert status == 200 and json.loads(raw)["usage"]["output_tokens"] == 5, raw
