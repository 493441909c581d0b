"""Running the app: `serve(config, ...)` binds its port, loads the model, serves it under uvicorn, and on
SIGINT/SIGTERM stops accepting, lets in-flight requests finish for a grace period, aborts the rest and
returns."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

import uvicorn

from ..config import ConfigError
from ..engine.async_engine import AsyncEngine
from ..engine.setup import has_tokenizer
from .app import build_app
from .limits import DEFAULT_LIMITS, ServerLimits

log = logging.getLogger("nextserve.server")


def serve(
    config,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | tuple[str, ...] | None = None,
    served_model_name: str | None = None,
    keepalive_s: float = 5.0,
    shutdown_timeout_s: float = 30.0,
    log_level: str = "info",
    limits: ServerLimits = DEFAULT_LIMITS,
    reasoning: bool = True,
    tool_call_format: str = "auto",
) -> int:
    """Binds host:port (a ConfigError when it cannot: before any model is loaded), loads the model and
    serves it until SIGINT/SIGTERM. On the signal it stops accepting connections, lets in-flight requests
    finish for up to shutdown_timeout_s, then aborts the rest (their clients get an error event or a 503,
    not a cut connection) and returns 0. A second signal aborts at once.

    # NOTE: when the engine cannot serve any more (a pipeline stage died: its requests have failed, and
    # /health answers 503 naming the stage) the server stops after FAILED_GRACE_S and returns 1, for a
    # supervisor (systemd's Restart=on-failure, a container's restart policy) to start it again; it does
    # not rebuild the pipeline itself."""
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    t0 = time.monotonic()
    if not config.skip_tokenizer and not has_tokenizer(config.model):
        raise ConfigError(
            f"{config.model} has no tokenizer (tokenizer.json / tokenizer_config.json): every text request "
            "would fail. Give --skip-tokenizer to serve token-id prompts only (answers then carry token ids)"
        )
    sock = bind_socket(host, port)  # NOTE: not listening yet: connections are refused while loading
    try:
        log.info("loading %s", config.model)
        engine = AsyncEngine(config)
    except BaseException:
        sock.close()
        raise
    timer: threading.Timer | None = None

    def stop(force: bool) -> None:
        nonlocal timer
        if force:
            engine.shutdown(abort_running=True, timeout=5.0)
        elif timer is None:
            timer = threading.Timer(shutdown_timeout_s, engine.shutdown, kwargs={"abort_running": True})
            timer.daemon = True
            timer.start()

    name = served_model_name or str(config.model)
    app = None
    try:
        app = build_app(engine, name, api_key, keepalive_s=keepalive_s, limits=limits, reasoning=reasoning,
                        tool_call_format=tool_call_format)  # fmt: skip
        app.state.nextserve.grammar.warm_up()
        where = sock.getsockname()

        def listening() -> None:
            log.info(
                "serving %s on http://%s:%d (started in %.1f s; max_context %d, stats %s)",
                name, where[0], where[1], time.monotonic() - t0, engine.engine.max_context, engine.stats(),
            )  # fmt: skip

        server = _GracefulServer(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                log_level=log_level,
                access_log=False,
                # NOTE: a backstop only: the engine aborts what is left after shutdown_timeout_s, and the
                # aborted requests then end on their own.
                timeout_graceful_shutdown=shutdown_timeout_s + 10.0,
                lifespan="off",
            ),
            on_signal=stop,
            grace_s=shutdown_timeout_s,
            on_started=listening,
        )
        watcher = threading.Thread(target=_stop_when_failed, args=(engine, server), daemon=True)
        watcher.start()
        server.run(sockets=[sock])
        if not server.started:
            raise ConfigError(f"could not serve on {host}:{port} (see the log above)")
        return 1 if engine.failure() is not None else 0
    finally:
        if timer is not None:
            timer.cancel()
        if app is not None:
            app.state.nextserve.prep.close()
            app.state.nextserve.grammar.close()
        engine.shutdown(abort_running=True)
        sock.close()
        log.info("stopped")


FAILED_GRACE_S = 5.0  # /health says 503 this long (for a load balancer to see) before the server stops


def _stop_when_failed(engine: AsyncEngine, server: uvicorn.Server) -> None:
    while not server.should_exit:
        failure = engine.failure()
        if failure is not None:
            log.error("the engine cannot serve any more (%s): stopping in %g s, exit code 1", failure,
                      FAILED_GRACE_S)  # fmt: skip
            time.sleep(FAILED_GRACE_S)
            server.should_exit = True
            return
        time.sleep(0.5)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not listening); ConfigError naming the address when it is taken."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r} is not an address this machine has: {exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} (is another server there?)"
        ) from None
    sock.set_inheritable(True)
    return sock


HARD_EXIT_S = 3.0  # after a second stop signal, the most the process may take to end


def _hard_exit() -> None:
    log.error("still running %g s after the second stop signal: exiting now", HARD_EXIT_S)
    logging.shutdown()
    os._exit(1)


class _GracefulServer(uvicorn.Server):
    """uvicorn's server with our stop policy: the first SIGINT/SIGTERM starts the grace period
    (and the process then exits 0 instead of re-raising the signal); a second one aborts at once."""

    def __init__(
        self, config, on_signal: Callable[[bool], None], grace_s: float, on_started: Callable[[], None]
    ) -> None:
        super().__init__(config)
        self.on_signal, self.grace_s, self.on_started = on_signal, grace_s, on_started

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_started()  # only now is the socket listening

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            log.warning(
                "second stop signal: aborting in-flight requests now; exiting within %g s", HARD_EXIT_S
            )
            self.force_exit = True
            self.on_signal(True)
            # NOTE: a thread that does not stop (a grammar compile inside xgrammar, which cannot be
            # interrupted) would hold the interpreter's exit; past HARD_EXIT_S the process ends regardless
            timer = threading.Timer(HARD_EXIT_S, _hard_exit)
            timer.daemon = True  # (a process that ends sooner does not wait for it)
            timer.start()
            return
        log.info(
            "received %s: no new connections; in-flight requests get %g s to finish",
            signal.Signals(sig).name,
            self.grace_s,
        )
        self.should_exit = True
        self.on_signal(False)
