"""The OpenAI-compatible HTTP app over an AsyncEngine: `build_app(engine, served_model_name, api_key)`.

Middleware (request counts, the API key, one log line per request), /health, /metrics, /v1/models, and the
two generation routes. Every request the engine sees was validated first, so a bad request costs the
engine nothing; a client that goes away aborts its request at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..engine.async_engine import AsyncEngine
from . import protocol as P
from . import routes_chat, routes_completions
from .checks import check_model
from .errors import APIError, install_error_handlers
from .metrics import CONTENT_TYPE
from .state import LOG_KEY, ServerState

request_log = logging.getLogger("nextserve.requests")

_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}
MAX_BODY_BYTES = 256 * 2**20  # a request body larger than this is answered 413


class _Middleware:
    """Counts requests by status, checks the API key on /v1, and writes one log line per request."""

    def __init__(self, app, srv: ServerState) -> None:
        self.app, self.srv = app, srv

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        status = [500]
        fields: dict[str, Any] = {}
        scope[LOG_KEY] = fields
        path = scope.get("path", "")

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.srv.api_key is not None and path.startswith("/v1") and not self._authorized(scope):
                err = APIError(
                    401, "Incorrect API key provided.", param=None, code="invalid_api_key"
                ).response()
                err.headers["WWW-Authenticate"] = "Bearer"
                await err(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            endpoint = (
                path if path in _ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")
            )
            self.srv.metrics.requests.labels(endpoint, str(status[0])).inc()
            if path.startswith("/v1") and scope.get("method") == "POST":
                record = {"event": "request", "path": path, "status": status[0]}
                record.update(fields)
                record["duration_s"] = round(time.monotonic() - t0, 4)
                request_log.info(json.dumps(record, default=str))

    def _authorized(self, scope) -> bool:
        for key, value in scope.get("headers", []):
            if key == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    token.strip().encode(), self.srv.api_key.encode()
                )
        return False


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    *,
    keepalive_s: float = 5.0,
) -> FastAPI:
    """The FastAPI app serving `engine` as the model `served_model_name`."""
    srv = ServerState.for_engine(engine, served_model_name, api_key, keepalive_s)
    app = FastAPI(
        title="nextserve", version="0.1.0", docs_url=None, redoc_url=None, max_body_size=MAX_BODY_BYTES
    )
    app.state.nextserve = srv
    app.add_middleware(_Middleware, srv=srv)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_alive():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        # NOTE: reading the engine's stats waits for the current step; do it off the event loop.
        return Response(await asyncio.to_thread(srv.metrics.render), media_type=CONTENT_TYPE)

    def _card() -> P.ModelCard:
        return P.ModelCard(id=srv.name, max_model_len=srv.max_context)

    @app.get("/v1/models", response_model=P.ModelList)
    async def models() -> P.ModelList:
        return P.ModelList(data=[_card()])

    @app.get("/v1/models/{model_id:path}", response_model=P.ModelCard)
    async def model(model_id: str) -> P.ModelCard:
        check_model(srv, model_id)
        return _card()

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse)
    async def chat_completions(req: P.ChatCompletionRequest, request: Request) -> Response:
        return await routes_chat.chat_completions(srv, req, request)

    @app.post("/v1/completions", response_model=P.CompletionResponse)
    async def completions(req: P.CompletionRequest, request: Request) -> Response:
        return await routes_completions.completions(srv, req, request)

    return app
