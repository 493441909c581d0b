"""A pipeline stage that dies under a live server (issue 21): the request in flight gets an error, not a
hang; /health answers 503 naming the stage; new requests are refused; the stages are reaped at shutdown.
(`nextserve serve` then stops and exits 1 after FAILED_GRACE_S: server/lifecycle.py.)"""

from __future__ import annotations

import json
import threading
import time

from live_server import MODEL_NAME, health_status, live_server, wait_healthy


def test_a_dead_stage_makes_health_503_and_fails_requests(tiny_model_dir) -> None:
    with live_server(tiny_model_dir, pipeline_stages=2) as srv:
        status, _, body = srv.request("GET", "/health")
        assert status == 200 and json.loads(body)["status"] == "ok"
        procs = list(srv.engine.engine.runner.procs)
        threading.Timer(0.5, procs[0].kill).start()
        t0 = time.monotonic()
        ask = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 900,
               "ignore_eos": True}  # fmt: skip
        status, _, body = srv.request("POST", "/v1/chat/completions", ask, timeout=60)
        assert time.monotonic() - t0 < 30
        assert status >= 500 and "pipeline stage 1" in json.loads(body)["error"]["message"], body
        status, _, body = srv.request("GET", "/health")
        assert status == 503 and "pipeline stage 1 exited" in json.loads(body)["reason"], body
        # later requests: a 503 with the reason and Retry-After, which clients retry (was a 500)
        for path, extra in (
            ("/v1/chat/completions", {}),
            ("/v1/messages", {}),
            ("/v1/responses", {"input": "x"}),
        ):
            status, headers, body = srv.request("POST", path, ask | {"max_tokens": 2} | extra)
            assert status == 503 and headers.get("retry-after") == "5", (path, status, body)
            err = json.loads(body)["error"]
            assert "cannot serve" in err["message"] and "pipeline stage 1" in err["message"], (path, body)
    assert all(p.poll() is not None for p in procs)


def _children(pid: int) -> list[int]:
    """Process ids whose parent is pid (from /proc)."""
    import os

    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def test_nextserve_serve_exits_1_after_a_stage_dies(tiny_model_dir) -> None:
    import http.client
    import os
    import signal
    import socket
    import subprocess
    import sys

    from nextserve.server.lifecycle import FAILED_GRACE_S

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "nextserve.cli", "serve", "--model", str(tiny_model_dir), "--port",
           str(port), "--device", "cpu", "--kv-capacity", "1024", "--max-context", "512",
           "--pipeline-stages", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip

    try:
        wait_healthy(proc, port)
        (stage,) = _children(proc.pid)
        os.kill(stage, signal.SIGKILL)
        ask = {"model": str(tiny_model_dir), "prompt": "Once", "max_tokens": 4}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(ask), {"Content-Type": "application/json"})
        assert conn.getresponse().status >= 500
        assert health_status(port) == 503
        rc = proc.wait(FAILED_GRACE_S + 30)
        log = proc.stdout.read()
        assert rc == 1, log
        assert "pipeline stage 1 exited" in log and "exit code 1" in log
    finally:
        if proc.poll() is None:
            proc.kill()


def test_clean_exits_with_stages_leave_no_traceback_and_no_process(tiny_model_dir) -> None:
    """`nextserve generate` and `nextserve serve` (stopped by SIGTERM) with two stages: exit 0, no traceback
    in the output, no stage process left (a stage whose driver goes without a stop stops quietly)."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    base = ["--model", str(tiny_model_dir), "--device", "cpu", "--kv-capacity", "1024", "--max-context",
            "512", "--pipeline-stages", "2"]  # fmt: skip
    cli = [sys.executable, "-m", "nextserve.cli"]
    gen = subprocess.run([*cli, "generate", *base, "--prompt", "Once", "--max-tokens", "6"], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert gen.returncode == 0 and "Traceback" not in gen.stderr, gen.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*cli, "serve", *base, "--port", str(port)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        wait_healthy(proc, port)
        stages = _children(proc.pid)
        assert len(stages) == 1
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        log = proc.stdout.read()
        assert rc == 0 and "Traceback" not in log, log
        time.sleep(0.5)
        assert not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in stages)
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    """Running (not a zombie awaiting its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
