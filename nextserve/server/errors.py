"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, and the app's handlers that
answer every failure (bad fields, unknown routes, bugs) in it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.outputs import RequestOutput

log = logging.getLogger("nextserve.server")
LOG_KEY = "nextserve.log"  # the scope key of a request's structured-log fields


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@contextlib.contextmanager
def dialect_param(chat_field: str, own_field: str) -> Iterator[None]:
    """Errors raised inside name the dialect's own field where the chat route's translation named its own."""
    try:
        yield
    except APIError as exc:
        if exc.param == chat_field:
            exc.param = own_field
        raise


def warn_ignored(route: str, fields: list[str], tools: list[str] = ()) -> None:
    """One warning line for what a request brought that this server ignores: unknown top-level fields, and
    tools it cannot run (left out of the prompt)."""
    parts = [f"unknown fields {', '.join(sorted(fields))}"] if fields else []
    parts += [f"tools this server cannot run, left out of the prompt: {', '.join(tools)}"] if tools else []
    if parts:
        log.warning("%s: ignored %s", route, "; ".join(parts))


def failure_error(out: RequestOutput) -> APIError:
    """The error of an output that ended in failure ("error") or was aborted by a shutdown ("abort")."""
    if out.finish_reason == "error":
        return APIError(
            500, f"generation failed: {out.error or 'unknown error'}", "server_error", code="engine_error"
        )
    return APIError(
        503, "the request was aborted: the server is shutting down", "server_error", code="aborted"
    )


def raise_for_failure(out: RequestOutput) -> None:
    if out.finish_reason in ("error", "abort"):
        raise failure_error(out)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """pydantic's errors of a request as one 400 naming the field."""
    # NOTE: a union field reports one error per member; the one whose location goes deepest is the
    # member the client meant (a list of content parts, not a string).
    first = max(errors, key=lambda e: len(e.get("loc", ())), default={"loc": (), "msg": "invalid request"})
    loc = _clean_loc(first.get("loc", ()))
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        msg, loc = "the request body is not valid JSON", []
    elif first.get("type") == "missing":
        msg = "field required" if loc else "the request body is missing"
    param = ".".join(loc) or None
    text = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem(s))"
    return bad(text, param=param)


# ---- handlers ---------------------------------------------------------------------------------------


def log_error(request: Request, err: APIError) -> None:
    """The request's log line (and its metrics) carry the error and the field it names."""
    fields = request.scope.get(LOG_KEY)
    if fields is not None:
        fields.update(error=err.message[:300], error_param=err.param)


def _respond(request: Request, err: APIError) -> JSONResponse:
    log_error(request, err)
    return err.response()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _respond(request, validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _respond(request, APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return _respond(request, APIError(500, f"internal error: {type(exc).__name__}", "server_error"))


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _clean_loc(loc) -> list[str]:
    """A pydantic error location as a request path: no "body" prefix, no union-member tags such as
    `str` or `list[int]` or `function-after[...]` (skipped: the path goes on to the field inside)."""
    out = []
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out.append(str(part))
            continue
        text = str(part)
        if text in _TYPE_TAGS or any(c in text for c in "[]'-") or text[:1].isupper():
            continue
        out.append(text)
    return out
