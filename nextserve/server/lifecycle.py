"""Running the app: `serve(config, ...)` loads the model, serves it under uvicorn, and on SIGINT/SIGTERM
stops accepting, lets in-flight requests finish for a grace period, aborts the rest and returns."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

import uvicorn

from ..engine.async_engine import AsyncEngine
from .app import build_app

log = logging.getLogger("nextserve.server")


def serve(
    config,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    keepalive_s: float = 5.0,
    shutdown_timeout_s: float = 30.0,
    log_level: str = "info",
) -> None:
    """Loads the model and serves it until SIGINT/SIGTERM. On the signal it stops accepting
    connections, lets in-flight requests finish for up to shutdown_timeout_s, then aborts the rest
    (their clients get an error event or a 503, not a cut connection) and returns. A second signal
    aborts at once."""
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    log.info("loading %s", config.model)
    engine = AsyncEngine(config)
    timer: threading.Timer | None = None

    def stop(force: bool) -> None:
        nonlocal timer
        if force:
            engine.shutdown(abort_running=True, timeout=5.0)
        elif timer is None:
            timer = threading.Timer(shutdown_timeout_s, engine.shutdown, kwargs={"abort_running": True})
            timer.daemon = True
            timer.start()

    try:
        app = build_app(engine, served_model_name or str(config.model), api_key, keepalive_s=keepalive_s)
        app.state.nextserve.grammar.warm_up()
        log.info(
            "serving %s on http://%s:%d (max_context %d, stats %s)",
            served_model_name or config.model,
            host,
            port,
            engine.engine.max_context,
            engine.stats(),
        )
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
        )
        server.run()
    finally:
        if timer is not None:
            timer.cancel()
        engine.shutdown(abort_running=True)
        log.info("stopped")


class _GracefulServer(uvicorn.Server):
    """uvicorn's server with our stop policy: the first SIGINT/SIGTERM starts the grace period
    (and the process then exits 0 instead of re-raising the signal); a second one aborts at once."""

    def __init__(self, config, on_signal: Callable[[bool], None], grace_s: float) -> None:
        super().__init__(config)
        self.on_signal, self.grace_s = on_signal, grace_s

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            log.warning("second stop signal: aborting in-flight requests now")
            self.force_exit = True
            self.on_signal(True)
            return
        log.info(
            "received %s: no new connections; in-flight requests get %g s to finish",
            signal.Signals(sig).name,
            self.grace_s,
        )
        self.should_exit = True
        self.on_signal(False)
