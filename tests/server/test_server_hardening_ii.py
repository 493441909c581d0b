"""Hardening II: what an attacker's requests did to the server, each now answered up front: schemas whose
compile took the machine's memory, keywords constrained decoding would silently loosen, raw-byte surrogates,
a degenerate repetition penalty. Each test fails on the code before its fix."""

from __future__ import annotations

import json
import os
import time

import pytest
from live_server import MODEL_NAME, assert_pool_full

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _schema_of(props: int) -> dict:
    names = [f"p{i}" for i in range(props)]
    return {"type": "object", "properties": {n: {"type": "string"} for n in names}, "required": names}


def test_a_2000_property_schema_is_a_400_at_once_with_the_memory_unchanged(server) -> None:
    """About 60 KB of JSON drove the server from 0.9 to 22 GB: its properties now count toward
    --max-schema-nodes, checked while the body is parsed."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": _schema_of(2000)}}
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 4, "response_format": fmt}
    before, t0 = _rss_mib(), time.monotonic()
    status, _, raw = server.request("POST", CHAT, body)
    took = time.monotonic() - t0
    assert status == 400 and "--max-schema-nodes" in json.loads(raw)["error"]["message"], raw
    assert took < 1.0 and _rss_mib() - before < 100, (took, _rss_mib() - before)


def test_a_40000_value_enum_is_a_400_at_once(server) -> None:
    """It compiled for 26 s (385 MB), past the timeout, and the compile went on: enum values count."""
    schema = {"type": "string", "enum": [f"value{i}" for i in range(40000)]}
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 4, "guided_json": schema}
    t0 = time.monotonic()
    status, _, raw = server.request("POST", CHAT, body)
    assert status == 400 and "--max-schema-nodes" in json.loads(raw)["error"]["message"], raw
    assert time.monotonic() - t0 < 2.0
    # a constrained request right after answers at once
    status, _, raw = server.request("POST", CHAT, {"model": MODEL_NAME, "messages": USER, "max_tokens": 4,
                                                   "guided_regex": "[cd]+"})  # fmt: skip
    assert status == 200 and set(json.loads(raw)["choices"][0]["message"]["content"]) <= set("cd"), raw


def test_800_properties_compile_well_inside_the_timeout(server) -> None:
    """It took 20.7 s and 4.8 GB while the unsatisfiability check serialized the compiled grammar."""
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 8,
            "guided_json": _schema_of(400)}  # fmt: skip
    t0 = time.monotonic()
    status, _, raw = server.request("POST", CHAT, body)
    assert status == 200 and time.monotonic() - t0 < 5.0, raw


UNENFORCED = [
    ({"not": {}}, "`not`"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "`allOf` with 2 branches"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "`uniqueItems`"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "`if`"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
     "`dependentRequired`"),
    ({"type": "array", "contains": {"const": 7}}, "`contains`"),
]  # fmt: skip


@pytest.mark.parametrize("schema,word", UNENFORCED, ids=[w.strip("`").split("`")[0] for _, w in UNENFORCED])
def test_keywords_constrained_decoding_cannot_enforce_are_refused(server, schema, word) -> None:
    """{"not": {}} returned a number and allOf of string and integer a string: loosened silently."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    chat = {"model": MODEL_NAME, "messages": USER, "max_tokens": 4, "response_format": fmt}
    responses = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 4,
                 "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}  # fmt: skip
    params = {"type": "object", "properties": {"a": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    tools = {
        "model": MODEL_NAME,
        "messages": USER,
        "max_tokens": 4,
        "tools": [tool],
        "tool_choice": "required",
    }
    for path, body, field in ((CHAT, chat, "response_format"), ("/v1/responses", responses, "text"),
                              (CHAT, tools, "tools")):  # fmt: skip
        status, _, raw = server.request("POST", path, body)
        err = json.loads(raw)["error"]
        assert status == 400 and word in err["message"] and (err["param"] or "").startswith(field), (
            path,
            err,
        )
    # the same names as property names, or inside data, are no keywords
    named = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"enum": [{"not": 1}]}}}
    status, _, raw = server.request("POST", CHAT, chat | {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": named}}})  # fmt: skip
    assert status == 200, raw
    assert_pool_full(server.wait_idle())


RAW_SURROGATE = (
    b'{"model": "tiny-test", "messages": [{"role": "user", "content": "a\xed\xa0\x80b"}], "max_tokens": 2}'
)


@pytest.mark.parametrize("path,raw", [
    (CHAT, RAW_SURROGATE),
    ("/v1/messages", RAW_SURROGATE),
    ("/v1/responses", b'{"model": "tiny-test", "input": "a\xed\xa0\x80b", "max_output_tokens": 2}'),
    ("/v1/completions", b'{"model": "tiny-test", "prompt": "a\xed\xa0\x80b", "max_tokens": 2}'),
    (CHAT, b'{"model": "\xed\xa0\x80", "messages": [{"role": "user", "content": "x"}]}'),
    (CHAT, json.dumps({"model": MODEL_NAME, "messages": USER}).encode("utf-16")),
], ids=["chat", "messages", "responses", "completions", "model", "utf16"])  # fmt: skip
def test_raw_byte_surrogates_and_non_utf8_bodies_are_a_400(server, path, raw) -> None:
    """They passed the check (it looked only for the \\ud800 escape) and were a 500 in the tokenizer."""
    status, _, data = server.request("POST", path, raw=raw)
    assert status == 400 and b"UTF-8" in data, data


def test_a_near_zero_repetition_penalty_samples(server) -> None:
    """1e-40 (inside (0, 2]) divided logits past float32's range: a 500 from the sampler."""
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 5, 6, 7], "max_tokens": 6, "temperature": 1.0,
            "repetition_penalty": 1e-40, "seed": 1}  # fmt: skip
    status, _, raw = server.request("POST", "/v1/completions", body)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] >= 1
    assert_pool_full(server.wait_idle())


# ---- compiles that run long or grow: tried in a worker process first -----------------------------------
def _enum(n: int) -> dict:
    return {"type": "string", "enum": [f"value{i}" for i in range(n)]}


def test_compiles_past_the_timeout_stop_and_leave_constrained_decoding_working(tiny_model_dir) -> None:
    """Two 40,000-value enums (26 s each to compile) got their 400 after the timeout but kept compiling,
    and every later constrained request hung. Now the worker is killed at the timeout, and replaced."""
    from live_server import live_server

    from nextserve.server.limits import ServerLimits

    # (2.5 s: the 40,000-value enums take 26 s; a small regex took over 1 s on a loaded 2-core CI machine)
    limits = ServerLimits(grammar_timeout_s=2.5, max_schema_nodes=10**6)
    with live_server(tiny_model_dir, limits=limits) as srv:
        before = _rss_mib()
        for _ in range(2):
            t0 = time.monotonic()
            body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, "guided_json": _enum(40000)}
            status, _, raw = srv.request("POST", CHAT, body)
            assert status == 400 and "--grammar-timeout" in json.loads(raw)["error"]["message"], raw
            assert time.monotonic() - t0 < 10.0  # (the first also starts the worker)
        t0 = time.monotonic()
        status, _, raw = srv.request("POST", CHAT, {"model": MODEL_NAME, "messages": USER, "max_tokens": 4,
                                                    "guided_regex": "[cd]+"})  # fmt: skip
        assert status == 200 and time.monotonic() - t0 < 10.0, raw
        assert _rss_mib() - before < 150  # the 385 MB compiles ran in the worker, not here
        assert_pool_full(srv.wait_idle())


def test_the_probe_bounds_time_and_memory_and_replaces_its_worker() -> None:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    from nextserve.engine_config import DEFAULT_MODEL
    from nextserve.server.grammar_probe import CompileTimeout, CompileTooLarge, GrammarProbe

    tok = PreTrainedTokenizerFast(tokenizer_file=f"{DEFAULT_MODEL}/tokenizer.json")
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=8192, stop_token_ids=[2]).serialize_json()
    opts = {"any_whitespace": True, "strict_mode": True}
    probe = GrammarProbe(info, memory_mib=4096, timeout_s=1.0)
    try:
        probe.check(("ebnf", 'root ::= "a"', {}))  # (starts the worker)
        with pytest.raises(CompileTimeout):
            probe.check(("json", json.dumps(_enum(40000)), opts))
        probe.check(("regex", "[cd]+", {}))  # a new worker
        probe.check(("json", "{not json", opts))  # a bad source passes: the server's compile names it
        small = GrammarProbe(info, memory_mib=40, timeout_s=30.0)
        try:
            with pytest.raises(CompileTooLarge, match="--grammar-memory-mib"):
                small.check(("json", json.dumps(_enum(40000)), opts))  # 385 MB in the server, 8 threads
            small.check(("regex", "[cd]+", {}))
        finally:
            small.close()
    finally:
        probe.close()


@pytest.mark.slow
def test_a_soak_of_mixed_bad_requests_leaves_the_memory_and_the_pool_as_they_were(server) -> None:
    """A few hundred bad requests of every kind this file covers, round after round: every one a 4xx (none
    a 5xx), the pool full after, and the process's memory within 20% of where it started."""
    bad = [
        ("POST", CHAT, None, RAW_SURROGATE),
        ("POST", CHAT, {"model": MODEL_NAME, "messages": USER, "guided_json": _enum(40000)}, None),
        ("POST", CHAT, {"model": MODEL_NAME, "messages": USER, "guided_json": _schema_of(2000)}, None),
        ("POST", CHAT, {"model": MODEL_NAME, "messages": USER, "guided_json": {"not": {}}}, None),
        ("POST", CHAT, {"model": MODEL_NAME, "messages": "x"}, None),
        ("POST", CHAT, {"model": MODEL_NAME, "messages": USER, "temperature": "hot"}, None),
        ("POST", "/v1/messages", {"model": MODEL_NAME, "messages": [], "max_tokens": 1}, None),
        ("POST", "/v1/responses", {"model": MODEL_NAME, "input": 5}, None),
        ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": [10**9]}, None),
        ("POST", CHAT, None, b"{" * 100),
    ]  # fmt: skip
    ok = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2}
    for method, path, body, raw in bad:  # first round: whatever is built once (the worker, tables) is built
        server.request(method, path, body, raw=raw)
    start = _rss_mib()
    statuses = []
    for _ in range(30):
        for method, path, body, raw in bad:
            statuses.append(server.request(method, path, body, raw=raw)[0])
        assert server.request("POST", "/v1/completions", ok)[0] == 200
    assert all(400 <= s < 500 for s in statuses), sorted(set(statuses))
    assert_pool_full(server.wait_idle())
    assert _rss_mib() < 1.2 * start, (start, _rss_mib())
