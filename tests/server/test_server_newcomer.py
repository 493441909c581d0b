"""What a new user trips over (one test per row of the newcomer issue): help for every flag, an honest
start-up (a busy port, a context past the model's positions, a directory without a tokenizer), tool calls
to undeclared functions, continue_final_message, file modes, the bench's name, the role chunk's timing."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time

import pytest
from live_server import MODEL_NAME, assert_pool_full, live_server

from nextserve.cli import build_parser
from nextserve.config import ConfigError
from nextserve.engine_config import EngineConfig

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]


def test_every_flag_has_help_that_gives_its_default():
    for name, sub in _subparsers(build_parser()).items():
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            flag = action.option_strings[0]
            assert action.help and len(action.help) > 10, f"{name} {flag} has no help"
            assert not action.help.startswith("engine setting"), f"{name} {flag} has only the generic help"
            if action.required or action.dest in ("out", "prompt", "model"):
                continue
            assert "default" in action.help or "(0: off)" in action.help, f"{name} {flag}: no default in help"


def test_dtype_help_lists_what_it_takes():
    serve = _subparsers(build_parser())["serve"]
    (dtype,) = [a for a in serve._actions if "--dtype" in a.option_strings]
    for name in ("auto", "bfloat16", "float16", "float32", "float64"):
        assert name in dtype.help


def _serve(model_dir, port: int, *extra: str, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nextserve.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    cmd += ["--device", "cpu", "--kv-capacity", "1024", "--max-context", "512", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_busy_port_fails_before_loading_and_never_claims_to_serve(tiny_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = _serve(tiny_model_dir, port)
    log = r.stdout + r.stderr
    assert r.returncode == 2, log
    assert f"cannot listen on 127.0.0.1:{port}" in log
    assert "serving" not in log and "loading" not in log  # refused before the model was read
    assert time.monotonic() - t0 < 30


def test_max_context_past_the_model_positions_is_refused(tiny_model_dir):
    from nextserve import LLM

    with pytest.raises(ConfigError, match="max_position_embeddings"):
        LLM(str(tiny_model_dir), device="cpu", max_context=4097)  # the tiny preset has 4096 positions
    LLM(str(tiny_model_dir), device="cpu", max_context=4096, kv_capacity=4096)


def test_a_directory_without_a_tokenizer_needs_skip_tokenizer(tiny_model_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in tiny_model_dir.iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, bare / f.name)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _serve(bare, port)
    assert r.returncode == 2 and "--skip-tokenizer" in r.stderr, r.stderr
    # with the flag it serves token ids
    with live_server(bare, skip_tokenizer=True) as srv:
        status, _, data = srv.request(
            "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
        )
        choice = json.loads(data)["choices"][0]
        assert status == 200 and choice["text"] == "" and len(choice["token_ids"]) == 3
        status, _, data = srv.request("POST", "/v1/completions", {"prompt": "text", "max_tokens": 3})
        assert status == 400 and json.loads(data)["error"]["param"] == "prompt"
    assert EngineConfig(skip_tokenizer=True).skip_tokenizer
    with pytest.raises(ConfigError):
        EngineConfig(skip_tokenizer="yes")


def _forced(text: str) -> str:
    """A grammar whose only sentence is `text`."""
    return "root ::= " + json.dumps(text)


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_to_an_undeclared_function_is_text(server, stream):
    client = server.client()
    fake = '<tool_call>\n{"name": "get_was", "arguments": {"city": "Paris"}}\n</tool_call>'
    real = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for text, called in ((fake, False), (real, True)):
        kw = dict(model=MODEL_NAME, messages=USER, tools=[WEATHER], tool_choice="auto", max_tokens=400)
        kw["extra_body"] = {"guided_grammar": _forced(text)}
        if not stream:
            r = client.chat.completions.create(**kw).choices[0]
            calls, content, finish = r.message.tool_calls or [], r.message.content, r.finish_reason
        else:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][
                0
            ]
        if called:
            assert calls and calls[0].function.name == "get_weather" and finish == "tool_calls"
        else:
            assert not calls and content == fake and finish == "stop"
    assert_pool_full(server.wait_idle())


def test_continue_final_message(server):
    tok = server.engine.tokenizer
    msgs = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "The fruit is"}]
    body = {"messages": msgs, "max_tokens": 2, "continue_final_message": True, "add_generation_prompt": False}
    status, _, data = server.request("POST", CHAT, body)
    assert status == 200, data
    text = tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    assert text.endswith("The fruit is")
    assert json.loads(data)["usage"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))
    for bad in ({"add_generation_prompt": True}, {"messages": msgs[:1]}):
        status, _, data = server.request("POST", CHAT, body | bad)
        assert status == 400 and json.loads(data)["error"]["param"] == "continue_final_message"


def test_make_model_files_are_readable_like_the_rest(tmp_path):
    from nextserve.model.make_model import make_model

    out = make_model("tiny", tmp_path / "m")
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    assert len(set(modes.values())) == 1, modes


def test_the_bench_names_itself_by_the_device_it_ran_on():
    from nextserve.bench import run

    assert "gpu_baseline" not in open(run.__file__).read()
    assert "issue 6" not in (run.__doc__ or "") + (sys.modules["nextserve.bench"].__doc__ or "")


def test_the_role_chunk_comes_with_the_first_token(server):
    """The first streamed chunk carries the role and the first token, so a client that times the first
    chunk measures the prefill (it once came before the prefill started)."""
    body = {"messages": USER, "max_tokens": 4, "stream": True, "return_token_ids": True, "ignore_eos": True}
    status, _, data = server.request("POST", CHAT, body)
    chunks = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["delta"]["role"] == "assistant" and len(first["token_ids"]) >= 1
    assert sum(len(c["choices"][0].get("token_ids", [])) for c in chunks if c["choices"]) == 4
