"""`nextserve serve`: its flags, and a real server process stopped by SIGTERM / SIGINT."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from live_server import wait_healthy

from nextserve.cli import build_parser, engine_config_from_args, main
from nextserve.engine_config import EngineConfig


def test_every_engine_field_is_a_serve_flag():
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    flags = {opt for action in serve._actions for opt in action.option_strings}
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in flags, f.name
    for flag in ("--host", "--port", "--api-key", "--served-model-name"):
        assert flag in flags


# Non-default values for known fields; others get one derived from their type and default.
KNOWN_VALUES = {
    "model": "/m",
    "dtype": "float32",
    "device": "cpu",
    "prefill_chunk": 32,
    "max_concurrency": 3,
    "kv_capacity": 2048,
    "max_context": 512,
    "page_size": 32,
    "max_pending": 7,
    "memory_headroom_mib": 0,
    "cpu_kv_budget_mib": 64,
    "seed": 9,
    "prefix_cache": True,  # (its flip, --no-prefix-cache, would refuse --host-state-slots 1)
    "prefix_cache_images": 5,
    "host_state_slots": 3,
    "speculative_method": "mtp",  # (--pipeline-windows, flipped on, needs it)
    "prefill_batch_chunks": 1,  # (more is one process's: --pipeline-stages is 2 here)
    "kv_dtype": "int8",
}


def test_flags_reach_engine_config():
    argv, expected = ["serve"], {}
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name in KNOWN_VALUES:
            value = KNOWN_VALUES[f.name]
            argv += [flag] if value is True else [flag, str(value)]
        elif isinstance(f.default, bool):
            value = not f.default
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(f.default, int):
            value = f.default + 1
            argv += [flag, str(value)]
        else:
            continue
        expected[f.name] = value
    args = build_parser().parse_args(argv + ["--port", "9000", "--api-key", "k"])
    cfg = engine_config_from_args(args)
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert args.port == 9000 and args.api_key == "k" and args.host == "127.0.0.1"
    defaults = engine_config_from_args(build_parser().parse_args(["serve", "--model", "/m"]))
    assert defaults == EngineConfig(model="/m")
    auto = build_parser().parse_args(["serve", "--model", "/m", "--kv-capacity", "auto"])
    assert engine_config_from_args(auto).kv_capacity == "auto"


def test_serve_with_a_missing_model_dir_is_a_clear_error(capsys):
    assert main(["serve", "--model", "/nonexistent/model-dir"]) == 2
    assert "/nonexistent/model-dir" in capsys.readouterr().err


def test_serve_defaults_to_the_embedded_model():
    from nextserve.cli import build_parser, engine_config_from_args
    from nextserve.config import ModelConfig
    from nextserve.engine_config import DEFAULT_MODEL

    args = build_parser().parse_args(["serve"])
    assert engine_config_from_args(args).model == DEFAULT_MODEL
    assert ModelConfig.from_dir(DEFAULT_MODEL).num_hidden_layers > 0


def test_bad_flag_values_are_clear_errors(capsys):
    for argv in (
        ["serve", "--model", "/m", "--page-size", "0"],
        ["serve", "--model", "/m", "--kv-capacity", "lots"],
        ["serve", "--model", "/m", "--kv-dtype", "int4"],
        ["serve", "--model", "/m", "--kv-dtype", "e4m3"],
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "page_size" in err and "kv_capacity" in err
    assert "kv_dtype must be one of auto, bf16, int8, fp8" in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(port: int, body: dict, out: dict) -> None:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request(
            "POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        out["status"] = resp.status
        lines = out.setdefault("lines", [])
        for line in resp:
            lines.append(line.decode().strip())
    except (OSError, http.client.HTTPException) as exc:
        out["error"] = repr(exc)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_gracefully(tiny_model_dir, sig):
    port = _free_port()
    # SIGTERM: the in-flight request may finish (30 s grace). SIGINT run: 0.3 s grace, then it is aborted.
    grace = "30" if sig == signal.SIGTERM else "0.3"
    cmd = [
        sys.executable,
        "-m",
        "nextserve.cli",
        "serve",
        "--model",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--device",
        "cpu",
        "--max-concurrency",
        "2",
        "--kv-capacity",
        "1024",
        "--max-context",
        "512",
        "--page-size",
        "16",
        "--shutdown-timeout",
        grace,
        "--served-model-name",
        "tiny",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, port)
        long = sig == signal.SIGINT
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 480 if long else 40,
            "stream": True,
            "ignore_eos": True,
        }
        out: dict = {}
        t = threading.Thread(target=_stream, args=(port, body, out))
        t.start()
        while not out.get("lines") and t.is_alive():
            time.sleep(0.01)
        proc.send_signal(sig)
        t.join(60)
        rc = proc.wait(60)
        log = proc.stdout.read()
        assert rc == 0, log
        if sig == signal.SIGTERM:
            assert out["status"] == 200 and "data: [DONE]" in out["lines"], out  # finished, not cut
            chunks = [json.loads(x[6:]) for x in out["lines"] if x.startswith("data: {")]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        else:
            # Cut short by the grace period, but told so: an error event, then [DONE].
            assert out["status"] == 200 and "data: [DONE]" in out["lines"], out
            errors = [json.loads(x[6:])["error"] for x in out["lines"] if x.startswith('data: {"error"')]
            assert errors and errors[0]["code"] == "aborted"
        assert '"event": "request"' in log
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_signal_ends_the_process_within_seconds(tiny_model_dir):
    """The first SIGTERM grants in-flight requests 30 s; a second ends everything at once: the process is
    gone within 5 s whatever still runs (a compile in xgrammar could hold it: a timer ends the process)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "nextserve.cli", "serve", "--model", str(tiny_model_dir),
           "--port", str(port), "--device", "cpu", "--max-context", "512", "--kv-capacity", "1024",
           "--page-size", "16", "--shutdown-timeout", "30"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, port)
        out: dict = {}
        body = {"prompt": "Once upon a time", "max_tokens": 480, "stream": True, "ignore_eos": True}
        t = threading.Thread(target=_stream, args=(port, body, out), daemon=True)
        t.start()
        while not out.get("lines") and t.is_alive():
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None  # the first one waits for the request
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        assert time.monotonic() - t0 < 5.0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
