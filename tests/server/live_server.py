"""Live servers for the API tests (helpers; conftest.py holds the fixtures): uvicorn on 127.0.0.1
(a free port), on a background thread, over an AsyncEngine on the tiny random checkpoint."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import uvicorn
from cpu_flags import CPU_FLAGS

from nextserve.engine.async_engine import AsyncEngine
from nextserve.engine_config import EngineConfig
from nextserve.server.app import build_app
from nextserve.server.limits import DEFAULT_LIMITS, ServerLimits

MODEL_NAME = "tiny-test"

# Small pools so waiting (for slots and for pages) is exercised.
BASE_FLAGS = CPU_FLAGS | dict(kv_capacity=4096, prefill_chunk=64, max_context=1024, max_pending=64)


@dataclass
class LiveServer:
    engine: AsyncEngine
    port: int
    api_key: str | None
    app: Any = None

    @property
    def state(self):
        """The app's ServerState."""
        return self.app.state.nextserve

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "none", **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "none", **kwargs)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60.0,
    ) -> tuple[int, dict[str, str], bytes]:
        """A plain HTTP request (no client-side checks): (status, headers, body bytes)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            h = {"Content-Type": "application/json"}
            if self.api_key:
                h["Authorization"] = f"Bearer {self.api_key}"
            h.update(headers or {})
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            conn.request(method, path, body=data, headers=h)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def wait_idle(self, timeout: float = 10.0) -> dict[str, int]:
        """Waits until nothing runs or waits, then returns stats()."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.engine.stats()
            if (s["running"] == 0 and s["waiting"] == 0) or time.monotonic() > deadline:
                return s


def health_status(port: int) -> int | None:
    """The status of GET /health on 127.0.0.1:port (None: nothing answers)."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None


def wait_healthy(proc, port: int, timeout: float = 90.0) -> None:
    """Waits until a `nextserve serve` subprocess answers /health with 200 (fails if it exits first)."""
    deadline = time.monotonic() + timeout
    while health_status(port) != 200:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def wait_until(cond, timeout: float = 5.0) -> bool:
    """Polls cond() every 10 ms until it holds (True) or timeout seconds pass (its last value)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def post_and_hold(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    """A raw connection that has sent POST path with body and reads nothing: close it to leave."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def assert_pool_full(stats: dict[str, int]) -> None:
    """Idle: every page free or held by a prefix image (a cache, on by default), every slot free."""
    assert stats["waiting"] == 0 and stats["running"] == 0, stats
    assert stats["kv_pages_free"] + stats["kv_pages_in_images"] == stats["kv_pages_total"], stats
    assert stats["state_slots_free"] == stats["state_slots_total"], stats


@contextlib.contextmanager
def live_server(
    model_dir,
    api_key: str | None = None,
    keepalive_s: float = 5.0,
    limits: ServerLimits = DEFAULT_LIMITS,
    reasoning: bool = True,
    tool_call_format: str = "auto",
    **flags,
) -> Iterator[LiveServer]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine thread and the test client share two cores
    engine = AsyncEngine(EngineConfig(model=str(model_dir), **(BASE_FLAGS | flags)))
    app = build_app(engine, MODEL_NAME, api_key, keepalive_s=keepalive_s, limits=limits, reasoning=reasoning,
                    tool_call_format=tool_call_format)  # fmt: skip
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield LiveServer(engine, port, api_key, app)
    finally:
        server.should_exit = True
        thread.join(15)
        app.state.nextserve.prep.close()
        app.state.nextserve.grammar.close()
        engine.shutdown()
        sock.close()
        torch.set_num_threads(threads)
