"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncEngine.

`build_app(engine, served_model_name, api_key)` makes the app; `serve(...)` runs it under uvicorn with
graceful SIGINT/SIGTERM handling. Every request the engine sees was validated here first, so a bad
request costs the engine nothing; a client that goes away aborts its request at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_engine import AsyncEngine
from ..engine.outputs import RequestOutput
from ..engine.sampling import SamplingParams
from ..engine.scheduler import QueueFull
from . import protocol as P
from .chat import CallArgs, CallStart, ContentDelta, Event, ToolCallParser, parse_tool_calls, render_chat
from .grammar import GrammarBackend, GrammarUnavailable
from .metrics import CONTENT_TYPE, ServerMetrics

log = logging.getLogger("nextserve.server")
request_log = logging.getLogger("nextserve.requests")

_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}
_LOG_KEY = "nextserve.log"  # the scope key of a request's structured-log fields
MAX_BODY_BYTES = 256 * 2**20  # a request body larger than this is answered 413


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


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- per-app state ------------------------------------------------------------------------------------


@dataclass
class _Server:
    engine: AsyncEngine
    name: str
    api_key: str | None
    keepalive_s: float
    metrics: ServerMetrics
    grammar: GrammarBackend
    tokenizer: Any
    vocab_size: int
    eos_token_id: int | None
    max_context: int
    model_path: str
    defaults: dict[str, Any] = field(default_factory=dict)  # generation_config.json sampling defaults
    token_cache: dict[int, tuple[str, list[int]]] = field(default_factory=dict)
    byte_decoder: dict[str, int] | None = None

    # -- tokens ---------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send the prompt as token ids")
        # NOTE: JSON may carry lone UTF-16 surrogates ("\ud800"), which no tokenizer takes; they become
        # U+FFFD, as a browser would show them.
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the text could not be tokenized: {exc}") from None

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_info(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text and its bytes, as OpenAI logprobs show them."""
        hit = self.token_cache.get(token_id)
        if hit is not None:
            return hit
        raw: bytes
        if self.tokenizer is None:
            raw = f"<{token_id}>".encode()
        else:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
            if piece is None:
                raw = b""
            elif token_id in added or self.byte_decoder is None:
                raw = (piece if token_id in added else self.tokenizer.decode([token_id])).encode()
            elif all(ch in self.byte_decoder for ch in piece):
                raw = bytes(self.byte_decoder[ch] for ch in piece)
            else:
                raw = self.tokenizer.decode([token_id]).encode()
        info = (raw.decode("utf-8", errors="replace"), list(raw))
        if len(self.token_cache) < 1_000_000:
            self.token_cache[token_id] = info
        return info

    def healthy(self) -> bool:
        probe = getattr(self.engine, "is_alive", None)
        if callable(probe):
            return bool(probe())
        thread = getattr(self.engine, "_thread", None)
        return (thread is None or thread.is_alive()) and not getattr(self.engine, "_stopping", False)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in type(decoder).__name__ + repr(decoder)[:200]


def _generation_defaults(model_dir: str) -> dict[str, Any]:
    """temperature/top_p/top_k from the model's generation_config.json, the defaults vLLM applies."""
    path = Path(model_dir) / "generation_config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    out: dict[str, Any] = {}
    if not isinstance(raw, dict):
        return out
    if isinstance(raw.get("temperature"), int | float) and raw.get("do_sample", True) is not False:
        out["temperature"] = float(raw["temperature"])
    if isinstance(raw.get("top_p"), int | float) and 0 < raw["top_p"] <= 1:
        out["top_p"] = float(raw["top_p"])
    if isinstance(raw.get("top_k"), int) and raw["top_k"] >= -1:
        out["top_k"] = int(raw["top_k"])
    return out


# ---- per-request bookkeeping ----------------------------------------------------------------------------


class _Tracker:
    """Timing, metrics and the structured log line of one generation request."""

    def __init__(self, srv: _Server, fields: dict[str, Any], request_id: str, prompt_tokens: int) -> None:
        self.srv, self.fields = srv, fields
        self.t0 = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.n = 0
        self.cached = 0
        self.prompt_tokens = prompt_tokens
        self.done = False
        fields.update(request_id=request_id, prompt_tokens=prompt_tokens)

    def update(self, out: RequestOutput) -> None:
        self.cached = out.cached_tokens
        k = len(out.token_ids) - self.n
        if k <= 0:
            return
        now = time.monotonic()
        m = self.srv.metrics
        if self.first is None:
            self.first = now
            m.ttft.observe(now - self.t0)
            k -= 1
        if k > 0 and self.last is not None:
            per = (now - self.last) / k
            for _ in range(k):
                m.itl.observe(per)
        self.last, self.n = now, len(out.token_ids)

    def finish(self, finish_reason: str | None) -> None:
        if self.done:
            return
        self.done = True
        m = self.srv.metrics
        m.prompt_tokens.inc(self.prompt_tokens)
        m.generation_tokens.inc(self.n)
        m.cached_tokens.inc(self.cached)
        m.finished.labels(finish_reason or "none").inc()
        now = time.monotonic()
        m.e2e.observe(now - self.t0)
        decode_s = (self.last - self.first) if self.first is not None and self.last is not None else 0.0
        self.fields.update(
            cached_tokens=self.cached,
            generated_tokens=self.n,
            ttft_s=round(self.first - self.t0, 4) if self.first is not None else None,
            tok_per_s=round((self.n - 1) / decode_s, 2) if self.n > 1 and decode_s > 0 else None,
            finish_reason=finish_reason,
        )


class _TextStream:
    """Text deltas from cumulative text, holding back what a stop string may still cut off."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = ""

    def delta(self, text: str, finished: bool) -> str:
        if not text.startswith(self.sent):
            # NOTE: detokenization changed text already sent (it should not); send only what is new.
            return ""
        upto = len(text) if finished else max(len(self.sent), len(text) - self.holdback)
        new = text[len(self.sent) : upto]
        self.sent += new
        return new


# ---- SSE -----------------------------------------------------------------------------------------------


class _EventStream(StreamingResponse):
    """An SSE response that notices a client disconnect at once (not at its next write) and then
    aborts the request: the engine frees its pages and slot before the next step."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], request_id: str) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request_id},
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(run)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_DONE = "data: [DONE]\n\n"


async def _outputs(queue: asyncio.Queue, keepalive_s: float | None) -> AsyncIterator[RequestOutput | None]:
    """The request's outputs (newest only, when several are waiting); None after keepalive_s of quiet."""
    while True:
        try:
            out = await asyncio.wait_for(queue.get(), keepalive_s) if keepalive_s else await queue.get()
        except TimeoutError:
            yield None
            continue
        while not out.finished and not queue.empty():
            out = queue.get_nowait()  # outputs are cumulative: the newest carries everything
        yield out
        if out.finished:
            return


# ---- the app ---------------------------------------------------------------------------------------------


class _Middleware:
    """Counts requests by status, checks the API key on /v1, and writes one log line per request."""

    def __init__(self, app, srv: _Server) -> None:
        self.app, self.srv = app, srv

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        status = [500]
        fields: dict[str, Any] = {}
        scope[_LOG_KEY] = fields
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
    llm = engine.engine
    tokenizer = llm.tokenizer
    srv = _Server(
        engine=engine,
        name=served_model_name,
        api_key=api_key or None,
        keepalive_s=keepalive_s,
        metrics=ServerMetrics(engine.stats),
        grammar=GrammarBackend(tokenizer, llm.model_config.vocab_size, llm.model_config.eos_token_id),
        tokenizer=tokenizer,
        vocab_size=llm.model_config.vocab_size,
        eos_token_id=llm.model_config.eos_token_id,
        max_context=llm.max_context,
        model_path=str(engine.config.model),
        defaults=_generation_defaults(str(engine.config.model)),
    )
    if tokenizer is not None and _is_byte_level(tokenizer):
        srv.byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}

    app = FastAPI(
        title="nextserve", version="0.1.0", docs_url=None, redoc_url=None, max_body_size=MAX_BODY_BYTES
    )
    app.state.nextserve = srv
    app.add_middleware(_Middleware, srv=srv)

    # -- errors --------------------------------------------------------------------------------------
    def _respond(request: Request, err: APIError) -> JSONResponse:
        fields = request.scope.get(_LOG_KEY)
        if fields is not None:
            fields.update(error=err.message[:300], error_param=err.param)
        return err.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        # NOTE: a union field reports one error per member; the one whose location goes deepest is the
        # member the client meant (a list of content parts, not a string).
        first = max(
            errors, key=lambda e: len(e.get("loc", ())), default={"loc": (), "msg": "invalid request"}
        )
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
        return _respond(request, _bad(text, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _respond(request, APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return _respond(request, APIError(500, f"internal error: {type(exc).__name__}", "server_error"))

    # -- plain endpoints -----------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if srv.healthy():
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
        _check_model(srv, model_id)
        return _card()

    # -- generation ----------------------------------------------------------------------------------
    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse)
    async def chat_completions(req: P.ChatCompletionRequest, request: Request) -> Response:
        return await _chat(srv, req, request)

    @app.post("/v1/completions", response_model=P.CompletionResponse)
    async def completions(req: P.CompletionRequest, request: Request) -> Response:
        return await _completion(srv, req, request)

    return app


# ---- shared request handling ----------------------------------------------------------------------------


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _clean_loc(loc) -> list[str]:
    """A pydantic error location as a request path: no "body" prefix, no union-member tags such as
    `str` or `list[int]` or `function-after[...]`."""
    out = []
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out.append(str(part))
            continue
        text = str(part)
        if text in _TYPE_TAGS or any(c in text for c in "[]'-") or text[:1].isupper():
            break
        out.append(text)
    return out


def _check_model(srv: _Server, model: str | None) -> None:
    if model is not None and model not in (srv.name, srv.model_path):
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def _check_common(srv: _Server, req: P._SamplingFields) -> None:
    _check_model(srv, req.model)
    if req.n not in (None, 1):
        raise _bad("only n=1 is supported: send one request per choice", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise _bad(f"{name} is not supported by this server; leave it unset or 0", param=name)
    if req.logit_bias:
        raise _bad("logit_bias is not supported by this server", param="logit_bias")
    for t in req.stop_token_ids or []:
        if t >= srv.vocab_size:
            raise _bad(f"stop_token_ids must be below the vocabulary size {srv.vocab_size}", "stop_token_ids")


def _check_chat(req: P.ChatCompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options is only allowed when stream is true", param="stream_options")
    if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
        raise _bad("top_logprobs needs logprobs set to true", param="top_logprobs")
    names = [t.function.name for t in req.tools or []]
    if len(set(names)) != len(names):
        raise _bad("tools must have distinct function names", param="tools")
    tc = req.tool_choice
    if tc is not None and tc not in ("none", "auto") and not req.tools:
        raise _bad("tool_choice other than none/auto needs tools", param="tool_choice")
    if isinstance(tc, P.NamedToolChoice) and tc.function.name not in names:
        raise _bad(
            f"tool_choice names {tc.function.name!r}, which is not among the tools", param="tool_choice"
        )


def _check_length(srv: _Server, n_prompt: int, max_tokens: int | None, prompt_param: str) -> None:
    if n_prompt == 0:
        raise _bad("the prompt is empty", param=prompt_param)
    if n_prompt >= srv.max_context:
        raise _bad(
            f"This model's maximum context length is {srv.max_context} tokens. However, your prompt has "
            f"{n_prompt} tokens, which leaves no room for a completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and n_prompt + max_tokens > srv.max_context:
        raise _bad(
            f"This model's maximum context length is {srv.max_context} tokens. However, you requested "
            f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion). "
            "Reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )


def _sampling(
    srv: _Server, req: P._SamplingFields, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    d = srv.defaults
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature if req.temperature is not None else d.get("temperature", 1.0),
            top_p=req.top_p if req.top_p is not None else d.get("top_p", 1.0),
            top_k=req.top_k if req.top_k is not None else d.get("top_k", -1),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )
    except ValueError as exc:
        raise _bad(str(exc)) from None


async def _constraint(srv: _Server, req: P._SamplingFields, tools: list[dict] | None, tool_choice: Any):
    """The request's grammar, if any: response_format, the guided_* / structured_outputs extensions,
    or forced tool calls (tool_choice required or named)."""
    g = srv.grammar
    asks: list[tuple[str, Callable[[], Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        asks.append(("response_format", g.compile_json_object))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_ if rf.json_schema else None
        asks.append(("response_format", lambda: g.compile_json_schema(schema)))
    if req.guided_json is not None:
        asks.append(("guided_json", lambda: g.compile_json_schema(req.guided_json)))
    if req.guided_regex is not None:
        asks.append(("guided_regex", lambda: g.compile_regex(req.guided_regex)))
    if req.guided_grammar is not None:
        asks.append(("guided_grammar", lambda: g.compile_ebnf(req.guided_grammar)))
    if req.guided_choice is not None:
        asks.append(("guided_choice", lambda: g.compile_choice(req.guided_choice)))
    so = req.structured_outputs
    if so is not None:
        given = [k for k in ("json_", "regex", "grammar", "choice") if getattr(so, k) is not None]
        if len(given) != 1:
            raise _bad(
                "structured_outputs needs exactly one of json, regex, grammar, choice", "structured_outputs"
            )
        k = given[0]
        fn = {"json_": g.compile_json_schema, "regex": g.compile_regex, "grammar": g.compile_ebnf}.get(
            k, g.compile_choice
        )
        value = getattr(so, k)
        asks.append(("structured_outputs", lambda: fn(value)))
    forced_tools = tools and (tool_choice == "required" or isinstance(tool_choice, P.NamedToolChoice))
    if forced_tools:
        forced = tool_choice.function.name if isinstance(tool_choice, P.NamedToolChoice) else None
        parallel = bool(getattr(req, "parallel_tool_calls", True))
        asks.append(("tool_choice", lambda: g.compile_tool_calls(tools, forced, parallel)))
    if not asks:
        return None
    if len(asks) > 1:
        raise _bad(
            "give at most one output constraint; got " + ", ".join(a[0] for a in asks), param=asks[1][0]
        )
    param, compile_fn = asks[0]
    if not g.available:
        if param == "tool_choice":
            # NOTE: without xgrammar a forced tool choice is a request the model may not honour; serve
            # it unconstrained (the tools are in the prompt) rather than refuse it.
            log.warning("tool_choice=%r served without a grammar: %s", tool_choice, g.error)
            return None
        raise _bad(f"structured output is unavailable on this server: {g.error}", param=param)
    try:
        compiled = await asyncio.to_thread(compile_fn)
    except GrammarUnavailable as exc:
        if param == "tool_choice":
            return None
        raise _bad(str(exc), param=param) from None
    except ValueError as exc:
        raise _bad(str(exc), param=param) from None
    return g.constraint(compiled)


def _add(srv: _Server, ids: list[int], params: SamplingParams, rid: str, constraint) -> asyncio.Queue:
    try:
        return srv.engine.add_request(ids, params, rid, constraint)
    except QueueFull as exc:
        raise APIError(
            503,
            f"The server is overloaded: {exc}. Retry shortly.",
            "server_overloaded",
            code="queue_full",
            headers={"Retry-After": "1"},
        ) from None
    except ValueError as exc:
        raise _bad(str(exc)) from None
    except RuntimeError as exc:
        raise APIError(
            503, f"The server is not accepting requests: {exc}", "server_error", code="unavailable"
        ) from None


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(srv: _Server, queue: asyncio.Queue, rid: str, request: Request, tracker: _Tracker):
    """The final output of a non-streamed request; aborts it if the client leaves first."""

    async def drain() -> RequestOutput:
        last = None
        async for out in _outputs(queue, None):
            tracker.update(out)
            last = out
        return last

    consume = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({consume, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not consume.done():
            consume.cancel()
            _abort(srv, rid)
            tracker.finish("client_disconnect")
        watch.cancel()
    if consume.cancelled():
        return None  # the client left; the request is aborted
    out = consume.result()
    tracker.finish(out.finish_reason)
    return out


def _raise_for_failure(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise APIError(
            500, f"generation failed: {out.error or 'unknown error'}", "server_error", code="engine_error"
        )
    if out.finish_reason == "abort":
        raise APIError(
            503, "the request was aborted: the server is shutting down", "server_error", code="aborted"
        )


def _stream_error(out: RequestOutput) -> str:
    if out.finish_reason == "error":
        err = APIError(
            500, f"generation failed: {out.error or 'unknown error'}", "server_error", code="engine_error"
        )
    else:
        err = APIError(
            503, "the request was aborted: the server is shutting down", "server_error", code="aborted"
        )
    return _sse(err.body())


def _usage(
    out: RequestOutput | None, n_prompt: int, n_gen: int | None = None, cached: int = 0
) -> dict[str, Any]:
    gen = len(out.token_ids) if out is not None else (n_gen or 0)
    cached = out.cached_tokens if out is not None else cached
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": gen,
        "total_tokens": n_prompt + gen,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _visible_count(srv: _Server, out: RequestOutput, params: SamplingParams) -> int:
    """Generated tokens that the text shows: all but a final stop token."""
    n = len(out.token_ids)
    if out.finished and out.finish_reason == "stop" and n:
        last = out.token_ids[-1]
        if (last == srv.eos_token_id and not params.ignore_eos) or last in params.stop_token_ids:
            return n - 1
    return n


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def _chat_logprobs(srv: _Server, out: RequestOutput, start: int, end: int) -> list[dict[str, Any]]:
    items = []
    for lp in (out.logprobs or [])[start:end]:
        tok, raw = srv.token_info(lp.token_id)
        top = []
        for tid, v in lp.top:
            t, b = srv.token_info(tid)
            top.append({"token": t, "logprob": _finite(v), "bytes": b})
        items.append({"token": tok, "logprob": _finite(lp.logprob), "bytes": raw, "top_logprobs": top})
    return items


# ---- /v1/chat/completions -------------------------------------------------------------------------------


async def _chat(srv: _Server, req: P.ChatCompletionRequest, request: Request) -> Response:
    _check_common(srv, req)
    _check_chat(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    tool_mode = bool(req.tools) and req.tool_choice != "none"

    def prepare() -> list[int]:
        return srv.encode(render_chat(srv.tokenizer, req))

    try:
        ids = await asyncio.to_thread(prepare)
    except ValueError as exc:
        raise _bad(str(exc), param="messages") from None
    _check_length(srv, len(ids), max_tokens, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling(srv, req, max_tokens, logprobs)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if tool_mode else None
    constraint = await _constraint(srv, req, tools, req.tool_choice)
    rid = "chatcmpl-" + uuid.uuid4().hex
    fields = request.scope.setdefault(_LOG_KEY, {})
    fields.update(endpoint="chat", stream=req.stream)
    tracker = _Tracker(srv, fields, rid, len(ids))
    queue = _add(srv, ids, params, rid, constraint)
    created = int(time.time())
    if req.stream:
        gen = _chat_stream(srv, req, queue, rid, created, len(ids), params, tool_mode, tracker)
        return _EventStream(gen, on_close=lambda: _close(srv, rid, tracker), request_id=rid)
    try:
        out = await _collect(srv, queue, rid, request, tracker)
    except BaseException:
        _abort(srv, rid)
        raise
    if out is None:
        return Response(status_code=499)  # nobody is listening
    _raise_for_failure(out)
    content: str | None = out.text
    calls = []
    if tool_mode:
        parsed = parse_tool_calls(out.text)
        content = parsed.content
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.calls
        ]
    finish = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": content, "tool_calls": calls},
        "logprobs": None,
        "finish_reason": finish,
    }
    if req.logprobs:
        choice["logprobs"] = {"content": _chat_logprobs(srv, out, 0, _visible_count(srv, out, params))}
    body = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": srv.name,
        "choices": [choice],
        "usage": _usage(out, len(ids)),
    }
    return JSONResponse(body, headers={"X-Request-Id": rid})


def _abort(srv: _Server, rid: str) -> None:
    """Aborts a request without holding up the event loop (abort waits for the engine's current step)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        srv.engine.abort(rid)
        return
    loop.run_in_executor(None, srv.engine.abort, rid)


def _close(srv: _Server, rid: str, tracker: _Tracker) -> None:
    if not tracker.done:
        _abort(srv, rid)
        tracker.finish("client_disconnect")


def _event_delta(ev: Event) -> dict[str, Any]:
    if isinstance(ev, ContentDelta):
        return {"content": ev.text}
    if isinstance(ev, CallStart):
        return {
            "tool_calls": [
                {
                    "index": ev.index,
                    "id": ev.id,
                    "type": "function",
                    "function": {"name": ev.name, "arguments": ""},
                }
            ]
        }
    assert isinstance(ev, CallArgs)
    return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}


async def _chat_stream(
    srv: _Server,
    req: P.ChatCompletionRequest,
    queue: asyncio.Queue,
    rid: str,
    created: int,
    n_prompt: int,
    params: SamplingParams,
    tool_mode: bool,
    tracker: _Tracker,
) -> AsyncIterator[str]:
    opts = req.stream_options or P.StreamOptions()
    include_usage, continuous = opts.include_usage, opts.include_usage and opts.continuous_usage_stats

    def chunk(delta: dict[str, Any], finish: str | None = None, lps: list | None = None, out=None) -> str:
        body: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": srv.name,
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": {"content": lps} if lps is not None else None,
                    "finish_reason": finish,
                }
            ],
        }
        if include_usage:
            body["usage"] = _usage(out, n_prompt, tracker.n, tracker.cached) if continuous else None
        return _sse(body)

    parser = ToolCallParser() if tool_mode else None
    texts = _TextStream(params.stop)
    lp_sent = 0
    pending: list[dict[str, Any]] = []
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for out in _outputs(queue, srv.keepalive_s):
            if out is None:
                yield ": keep-alive\n\n"
                continue
            tracker.update(out)
            if out.finish_reason in ("error", "abort"):
                tracker.finish(out.finish_reason)
                yield _stream_error(out)
                yield _DONE
                return
            if req.logprobs:
                visible = _visible_count(srv, out, params)
                pending += _chat_logprobs(srv, out, lp_sent, visible)
                lp_sent = max(lp_sent, visible)
            delta = texts.delta(out.text, out.finished)
            if parser is not None:
                events = parser.feed(delta) + (parser.finish() if out.finished else [])
            else:
                events = [ContentDelta(delta)] if delta else []
            for ev in events:
                lps = pending if req.logprobs and pending else None
                if lps is not None:
                    pending = []
                yield chunk(_event_delta(ev), lps=lps, out=out)
            if out.finished:
                tracker.finish(out.finish_reason)
                called = parser is not None and parser.calls
                finish = "tool_calls" if called and out.finish_reason == "stop" else out.finish_reason
                yield chunk({}, finish, lps=pending if req.logprobs and pending else None, out=out)
                if include_usage:
                    yield _sse(
                        {
                            "id": rid,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": srv.name,
                            "choices": [],
                            "usage": _usage(out, n_prompt),
                        }
                    )
                yield _DONE
                return
    finally:
        _close(srv, rid, tracker)


# ---- /v1/completions ------------------------------------------------------------------------------------


async def _completion(srv: _Server, req: P.CompletionRequest, request: Request) -> Response:
    _check_common(srv, req)
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options is only allowed when stream is true", param="stream_options")
    if req.best_of not in (None, 1):
        raise _bad("only best_of=1 is supported", param="best_of")
    if req.suffix:
        raise _bad("suffix is not supported by this model", param="suffix")
    if req.echo and req.logprobs is not None:
        raise _bad("echo with logprobs is not supported (no prompt logprobs)", param="echo")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise _bad("send one prompt per request (batched prompts are not supported)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            ids = await asyncio.to_thread(srv.encode, prompt)
        except ValueError as exc:
            raise _bad(str(exc), param="prompt") from None
        prompt_text = prompt
    else:
        ids = list(prompt)
        if any(t < 0 or t >= srv.vocab_size for t in ids):
            raise _bad(f"prompt token ids must be in [0, {srv.vocab_size})", param="prompt")
        prompt_text = srv.decode(ids) if req.echo else ""
    _check_length(srv, len(ids), req.max_tokens, "prompt")
    params = _sampling(srv, req, req.max_tokens, req.logprobs)
    constraint = await _constraint(srv, req, None, None)
    rid = "cmpl-" + uuid.uuid4().hex
    fields = request.scope.setdefault(_LOG_KEY, {})
    fields.update(endpoint="completions", stream=req.stream)
    tracker = _Tracker(srv, fields, rid, len(ids))
    queue = _add(srv, ids, params, rid, constraint)
    created = int(time.time())
    echo = prompt_text if req.echo else ""
    if req.stream:
        gen = _completion_stream(srv, req, queue, rid, created, len(ids), params, tracker, echo)
        return _EventStream(gen, on_close=lambda: _close(srv, rid, tracker), request_id=rid)
    try:
        out = await _collect(srv, queue, rid, request, tracker)
    except BaseException:
        _abort(srv, rid)
        raise
    if out is None:
        return Response(status_code=499)  # nobody is listening
    _raise_for_failure(out)
    choice: dict[str, Any] = {
        "index": 0,
        "text": echo + out.text,
        "logprobs": None,
        "finish_reason": out.finish_reason,
    }
    if req.logprobs is not None:
        choice["logprobs"] = _completion_logprobs(srv, out, 0, _visible_count(srv, out, params), len(echo))
    body = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": srv.name,
        "choices": [choice],
        "usage": _usage(out, len(ids)),
    }
    return JSONResponse(body, headers={"X-Request-Id": rid})


def _completion_logprobs(
    srv: _Server, out: RequestOutput, start: int, end: int, offset: int
) -> dict[str, Any]:
    res: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in (out.logprobs or [])[start:end]:
        tok, _ = srv.token_info(lp.token_id)
        res["tokens"].append(tok)
        res["token_logprobs"].append(_finite(lp.logprob))
        res["top_logprobs"].append({srv.token_info(t)[0]: _finite(v) for t, v in lp.top} if lp.top else None)
        res["text_offset"].append(offset)
        offset += len(tok)
    return res


async def _completion_stream(
    srv: _Server,
    req: P.CompletionRequest,
    queue: asyncio.Queue,
    rid: str,
    created: int,
    n_prompt: int,
    params: SamplingParams,
    tracker: _Tracker,
    echo: str,
) -> AsyncIterator[str]:
    opts = req.stream_options or P.StreamOptions()
    include_usage, continuous = opts.include_usage, opts.include_usage and opts.continuous_usage_stats

    def chunk(text: str, finish: str | None = None, lps: dict | None = None, out=None) -> str:
        body: dict[str, Any] = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": srv.name,
            "choices": [{"index": 0, "text": text, "logprobs": lps, "finish_reason": finish}],
        }
        if include_usage:
            body["usage"] = _usage(out, n_prompt, tracker.n, tracker.cached) if continuous else None
        return _sse(body)

    texts = _TextStream(params.stop)
    lp_sent, offset = 0, len(echo)
    try:
        if echo:
            yield chunk(echo)
        async for out in _outputs(queue, srv.keepalive_s):
            if out is None:
                yield ": keep-alive\n\n"
                continue
            tracker.update(out)
            if out.finish_reason in ("error", "abort"):
                tracker.finish(out.finish_reason)
                yield _stream_error(out)
                yield _DONE
                return
            lps = None
            if req.logprobs is not None:
                visible = _visible_count(srv, out, params)
                if visible > lp_sent:
                    lps = _completion_logprobs(srv, out, lp_sent, visible, offset)
                    offset += sum(len(t) for t in lps["tokens"])
                    lp_sent = visible
            delta = texts.delta(out.text, out.finished)
            if delta or lps is not None:
                yield chunk(delta, lps=lps, out=out)
            if out.finished:
                tracker.finish(out.finish_reason)
                yield chunk("", out.finish_reason, out=out)
                if include_usage:
                    yield _sse(
                        {
                            "id": rid,
                            "object": "text_completion",
                            "created": created,
                            "model": srv.name,
                            "choices": [],
                            "usage": _usage(out, n_prompt),
                        }
                    )
                yield _DONE
                return
    finally:
        _close(srv, rid, tracker)


# ---- running it -----------------------------------------------------------------------------------------


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
    import uvicorn

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


try:
    import uvicorn as _uvicorn
except ImportError:  # pragma: no cover - uvicorn ships with the server extra
    _uvicorn = None

if _uvicorn is not None:

    class _GracefulServer(_uvicorn.Server):
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
