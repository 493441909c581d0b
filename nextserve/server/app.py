"""The OpenAI-compatible HTTP app over an AsyncEngine: `build_app(engine, served_model_name, api_key)`.

Middleware (request counts, the API key, one log line per request), /health, /metrics, /v1/models, and the
two generation routes. Every request the engine sees was validated first, so a bad request costs the
engine nothing; a client that goes away aborts its request at once (counted and logged once, as status
499). The generation routes read their bodies themselves, so that parsing and validation run off the event
loop (server/prepare.py); their OpenAPI schema still names the request models.
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
from pydantic.json_schema import models_json_schema

from ..engine.async_engine import AsyncEngine
from . import answers as A
from . import protocol as P
from . import routes_chat, routes_completions, routes_messages, routes_responses
from .anthropic import CountTokensRequest, MessagesRequest
from .body import BodyTooLarge
from .checks import check_model
from .errors import LOG_KEY, APIError, install_error_handlers
from .generation import CLIENT_GONE
from .limits import DEFAULT_LIMITS, ServerLimits
from .metrics import CONTENT_TYPE
from .prepare import ClientGone
from .responses import InputTokensRequest, ResponsesRequest
from .routes_messages import anthropic_error
from .state import ServerState
from .streaming import GONE_KEY
from .tenants import TENANT_KEY, tenant_salt

request_log = logging.getLogger("nextserve.requests")

_ENDPOINTS = {
    "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/models",
    "/v1/responses", "/v1/responses/input_tokens", "/health", "/metrics",
}  # fmt: skip
_BODIES = {
    "/v1/chat/completions": P.ChatCompletionRequest, "/v1/completions": P.CompletionRequest,
    "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/responses": ResponsesRequest, "/v1/responses/input_tokens": InputTokensRequest,
}  # fmt: skip


class _Middleware:
    """Counts requests by status, checks the API key on /v1, answers bodies past --max-request-mib with a
    413 (by their Content-Length at once, a chunked one as soon as it passes the limit), and writes one
    log line per request."""

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
            # NOTE: the Messages dialect's routes answer in its own error shape, from here on too
            shaped = anthropic_error if path.startswith("/v1/messages") else APIError.response
            if self.srv.api_key is not None and path.startswith("/v1") and not self._authorized(scope):
                err = shaped(APIError(401, "Incorrect API key provided.", param=None, code="invalid_api_key"))
                err.headers["WWW-Authenticate"] = "Bearer"
                await err(scope, receive, send_status)
                return
            failure = self.srv.engine.failure() if path.startswith("/v1") else None
            if failure is not None and scope.get("method") == "POST":
                # NOTE: the engine cannot serve any more (a pipeline stage died; the server stops soon for its
                # supervisor to restart it): a 503 with the reason, which clients retry, not a 500
                err = APIError(503, f"the engine cannot serve: {failure}", "service_unavailable",
                               code="engine_unavailable", headers={"Retry-After": "5"})  # fmt: skip
                await shaped(err)(scope, receive, send_status)
                return
            limit = self.srv.limits.max_request_bytes
            if _content_length(scope) > limit:
                await shaped(_too_large(limit))(scope, receive, send_status)
                return
            await self.app(scope, _counted(receive, limit), send_status)
        finally:
            if scope.get(GONE_KEY):
                status[0] = CLIENT_GONE
                fields.setdefault("error", "the client disconnected")
            endpoint = (
                path
                if path in _ENDPOINTS
                else (
                    "/v1/models"
                    if path.startswith("/v1/models/")
                    else "/v1/responses"
                    if path.startswith("/v1/responses/")
                    else "other"
                )
            )
            self.srv.metrics.requests.labels(endpoint, str(status[0])).inc()
            if path.startswith("/v1") and scope.get("method") == "POST":
                record = {"event": "request", "path": path, "status": status[0]}
                record.update(fields)
                record["duration_s"] = round(time.monotonic() - t0, 4)
                request_log.info(json.dumps(record, default=str))

    def _authorized(self, scope) -> bool:
        """Whether the bearer token (or the x-api-key header, Anthropic's) is one of the keys; the key's
        tenant salt goes into the scope."""
        for key, value in scope.get("headers", []):
            if key == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return self._known(scope, token.strip().encode())
            elif key == b"x-api-key":
                return self._known(scope, value.strip())
        return False

    def _known(self, scope, given: bytes) -> bool:
        # NOTE: every key compared (constant time each), so the time says nothing of which matched
        hits = [hmac.compare_digest(given, k.encode()) for k in self.srv.api_key]
        if not any(hits):
            return False
        scope[TENANT_KEY] = tenant_salt(self.srv.api_key[hits.index(True)])
        return True


def _content_length(scope) -> int:
    for key, value in scope.get("headers", []):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server takes ({limit} bytes, --max-request-mib).",
        code="request_too_large",
    )


def _counted(receive, limit: int):
    """`receive` that raises BodyTooLarge once the body passes `limit` bytes."""
    seen = [0]

    async def counted():
        message = await receive()
        if message["type"] == "http.request":
            seen[0] += len(message.get("body", b""))
            if seen[0] > limit:
                raise BodyTooLarge
        return message

    return counted


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | tuple[str, ...] | None = None,
    *,
    keepalive_s: float = 5.0,
    limits: ServerLimits = DEFAULT_LIMITS,
    reasoning: bool = True,
    tool_call_format: str = "auto",
) -> FastAPI:
    """The FastAPI app serving `engine` as the model `served_model_name` (`reasoning` False: --reasoning
    off, the template's thinking off unless a request asks for it; `tool_call_format`: --tool-call-format)."""
    srv = ServerState.for_engine(engine, served_model_name, api_key, keepalive_s, limits)
    srv.thinking_off = not reasoning and srv.template_thinks
    if tool_call_format not in ("auto", "json", "xml"):
        raise ValueError(f"tool_call_format must be auto, json or xml, got {tool_call_format!r}")
    if tool_call_format != "auto":
        srv.tool_call_xml = tool_call_format == "xml"
    app = FastAPI(title="nextserve", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.nextserve = srv
    app.add_middleware(_Middleware, srv=srv)
    install_error_handlers(app)

    @app.exception_handler(BodyTooLarge)
    async def _body_too_large(request: Request, exc: BodyTooLarge) -> Response:
        err = _too_large(limits.max_request_bytes)
        return anthropic_error(err) if request.url.path.startswith("/v1/messages") else err.response()

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        request.scope.setdefault(LOG_KEY, {})["error"] = "the client disconnected"
        return Response(status_code=CLIENT_GONE)

    @app.get("/health")
    async def health() -> Response:
        if (failure := engine.failure()) is not None:
            return JSONResponse({"status": "unavailable", "reason": failure}, status_code=503)
        if engine.is_alive():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": "shutting down"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        # NOTE: reading the engine's stats waits for the current step; do it off the event loop.
        return Response(await asyncio.to_thread(srv.metrics.render), media_type=CONTENT_TYPE)

    def _card() -> A.ModelCard:
        return A.ModelCard(id=srv.name, max_model_len=srv.max_context)

    @app.get("/v1/models", response_model=A.ModelList)
    async def models() -> A.ModelList:
        return A.ModelList(data=[_card()])

    @app.get("/v1/models/{model_id:path}", response_model=A.ModelCard)
    async def model(model_id: str) -> A.ModelCard:
        check_model(srv, model_id)
        return _card()

    body = {"requestBody": {"required": True, "content": {"application/json": {"schema": {}}}}}

    @app.post("/v1/chat/completions", response_model=A.ChatCompletionResponse, openapi_extra=body)
    async def chat_completions(request: Request) -> Response:
        return await routes_chat.chat_completions(srv, request)

    @app.post("/v1/completions", response_model=A.CompletionResponse, openapi_extra=body)
    async def completions(request: Request) -> Response:
        return await routes_completions.completions(srv, request)

    @app.post("/v1/messages", openapi_extra=body)
    async def messages(request: Request) -> Response:
        return await routes_messages.messages(srv, request)

    @app.post("/v1/messages/count_tokens", openapi_extra=body)
    async def count_tokens(request: Request) -> Response:
        return await routes_messages.count_tokens(srv, request)

    @app.post("/v1/responses", openapi_extra=body)
    async def responses(request: Request) -> Response:
        return await routes_responses.create(srv, request)

    @app.post("/v1/responses/input_tokens", openapi_extra=body)
    async def responses_input_tokens(request: Request) -> Response:
        return await routes_responses.input_tokens(srv, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        return await routes_responses.retrieve(srv, request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return await routes_responses.delete(srv, request, response_id)

    _document_bodies(app)
    return app


def _document_bodies(app: FastAPI) -> None:
    """The generation routes' request models in the OpenAPI document (they read their bodies themselves)."""
    plain = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = plain()
        refs, defs = models_json_schema(
            [(m, "validation") for m in _BODIES.values()], ref_template="#/components/schemas/{model}"
        )
        doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        for path, model in _BODIES.items():
            content = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
            content["schema"] = refs[(model, "validation")]
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
