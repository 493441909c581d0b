"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages dialect over the chat route's
machinery (server/anthropic.py translates the request); answers, streamed events and errors in that
dialect's shapes."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.outputs import RequestOutput
from . import anthropic as A
from .answer_stream import AnswerStream
from .body import BodyTooLarge, parse_body
from .errors import APIError, dialect_param, failure_error, log, log_error, warn_ignored
from .generation import CLIENT_GONE, Generation, failed
from .prepare import ClientGone
from .reasoning import reasoning_opened, split_reasoning
from .routes_chat import chat_prompt, checked_chat, start_chat, translated_chat
from .state import ServerState
from .streaming import KEEPALIVE, EventStream
from .tool_calls import CallArgs, CallStart, ContentDelta, parse_tool_calls

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def anthropic_error(exc: APIError) -> JSONResponse:
    return JSONResponse(A.error_body(exc.status, exc.message), status_code=exc.status, headers=exc.headers)


async def _chat_of(srv: ServerState, request: Request, model: type) -> tuple[Any, Any]:
    raw = await request.body()
    req = await srv.prep.run(request, parse_body, raw, model, srv.limits)
    chat = translated_chat(srv, lambda context: A.chat_request(req, context))
    warn_ignored(request.url.path, list(req.model_extra or {}), A.server_tools(req))
    return req, checked_chat(srv, chat)


async def count_tokens(srv: ServerState, request: Request) -> Response:
    try:
        async with srv.prep.admit():
            _, chat = await _chat_of(srv, request, A.CountTokensRequest)
            ids, _ = await chat_prompt(srv, request, chat)
    except APIError as exc:
        log_error(request, exc)
        return anthropic_error(exc)
    return JSONResponse({"input_tokens": len(ids)})


async def messages(srv: ServerState, request: Request) -> Response:
    try:
        return await _messages(srv, request)
    except APIError as exc:
        log_error(request, exc)
        return anthropic_error(exc)
    except (ClientGone, BodyTooLarge):
        raise  # the app's handlers answer these (499, 413 in this dialect's shape via the middleware)
    except Exception as exc:  # noqa: BLE001 - a bug: answered in this dialect's shape, and logged
        log.exception("internal error on /v1/messages")
        err = APIError(500, f"internal error: {type(exc).__name__}", "server_error")
        log_error(request, err)
        return anthropic_error(err)


async def _messages(srv: ServerState, request: Request) -> Response:
    async with srv.prep.admit():
        req, chat = await _chat_of(srv, request, A.MessagesRequest)
        # NOTE: Anthropic clients send their model's output maximum (Claude Code: 64,000) whatever the
        # context, so max_tokens is an upper bound here: cut to the room the context leaves
        with dialect_param("response_format", "output_config.format"):
            gen, ids, names = await start_chat(srv, request, chat, req.max_tokens, None, clamp=True)
    reply = _Reply(srv, gen, req, names, reasoning_opened(srv, ids))
    if req.stream:
        return EventStream(reply.events(), on_close=gen.close, request_id=reply.id)
    outs = await gen.finished_outputs(request)
    if outs is None:
        return Response(status_code=CLIENT_GONE)
    (out,) = outs
    return JSONResponse(reply.whole(out), headers={"X-Request-Id": reply.id})


class _Reply:
    """One Messages answer: whole, or as the dialect's event stream."""

    def __init__(
        self, srv: ServerState, gen: Generation, req: A.MessagesRequest, names: dict[str, Any] | None,
        opened: bool | None,
    ) -> None:  # fmt: skip
        self.srv, self.gen, self.req, self.names, self.opened = srv, gen, req, names, opened
        self.id = "msg_" + uuid.uuid4().hex

    def usage(self, out: RequestOutput, output_tokens: int | None = None) -> dict[str, int]:
        """The dialect's usage of `out` (input_tokens do not count the cached ones, as Anthropic's)."""
        cached = out.cached_tokens
        return {
            "input_tokens": self.gen.n_prompt - cached,
            "output_tokens": len(out.token_ids) if output_tokens is None else output_tokens,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
        }

    def stop(self, out: RequestOutput, called: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of a finished output."""
        if called and out.finish_reason == "stop":
            return "tool_use", None
        seq = self._stop_sequence(out) if out.finish_reason == "stop" else None
        if seq is not None:
            return "stop_sequence", seq
        return STOP_REASONS.get(out.finish_reason or "stop", "end_turn"), None

    def _stop_sequence(self, out: RequestOutput) -> str | None:
        """The stop sequence that ended the text (the engine cuts the text before it)."""
        stops = self.req.stop_sequences or []
        if not stops or self.srv.tokenizer is None:
            return None
        full = self.srv.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        rest = full[len(out.text) :] if full.startswith(out.text) else full
        return next((s for s in stops if rest.startswith(s)), None)

    def whole(self, out: RequestOutput) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        thought, answer = (
            split_reasoning(out.text, self.opened) if self.opened is not None else (None, out.text)
        )
        if thought:
            content.append({"type": "thinking", "thinking": thought, "signature": ""})
        text, calls = answer, []
        if self.names is not None:
            parsed = parse_tool_calls(answer, self.names)
            text, calls = parsed.content or "", parsed.calls
            inputs = [_object(c.arguments) for c in calls]
            if any(i is None for i in inputs):  # a call cut short (max_tokens) or malformed: the text as is
                text, calls = answer, []
        if text:
            content.append({"type": "text", "text": text})
        for c, given in zip(calls, inputs if calls else [], strict=True):
            content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": given})
        reason, seq = self.stop(out, bool(calls))
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.srv.name, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "usage": self.usage(out),
        }  # fmt: skip

    async def events(self) -> AsyncIterator[str]:
        gen = self.gen
        answer = AnswerStream(gen.params.stop, self.opened, self.names)
        blocks = _Blocks()
        started = False
        try:
            async for out in gen.outputs():
                if out is None:
                    # NOTE: Anthropic's stream opens with message_start, whose usage needs the first
                    # output (the prompt's cached tokens): until then a quiet stream hears SSE comments
                    yield _event("ping", {"type": "ping"}) if started else KEEPALIVE
                    continue
                if failed(out):
                    err = failure_error(out)
                    yield _event("error", A.error_body(err.status, err.message))
                    return
                if not started:
                    started = True
                    yield _event("message_start", {"type": "message_start", "message": {
                        "id": self.id, "type": "message", "role": "assistant", "model": self.srv.name,
                        "content": [], "stop_reason": None, "stop_sequence": None,
                        "usage": self.usage(out, output_tokens=0),
                    }})  # fmt: skip
                for text in answer.write(out, blocks):
                    yield text
                if out.finished:
                    reason, seq = self.stop(out, answer.called)
                    gen.tracker.finish(out.finish_reason)
                    yield _event("message_delta", {
                        "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                        "usage": {"output_tokens": len(out.token_ids)},
                    })  # fmt: skip
                    yield _event("message_stop", {"type": "message_stop"})
                    return
        finally:
            gen.close()


class _Blocks:
    """Content blocks as the stream opens and closes them: text, and a tool_use block per call."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block's kind

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.kind = kind
        out.append(_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block}))  # fmt: skip
        return out

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event(
            "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}
        )

    def thinking(self, text: str) -> list[str]:
        if not text:
            return []
        block = {"type": "thinking", "thinking": "", "signature": ""}
        out = [] if self.kind == "thinking" else self._open("thinking", block)
        return out + [self._delta({"type": "thinking_delta", "thinking": text})]

    def event(self, ev: Any) -> list[str]:
        if isinstance(ev, ContentDelta):
            out = [] if self.kind == "text" else self._open("text", {"type": "text", "text": ""})
            return out + [self._delta({"type": "text_delta", "text": ev.text})]
        if isinstance(ev, CallStart):
            return self._open("tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
        assert isinstance(ev, CallArgs)
        return [self._delta({"type": "input_json_delta", "partial_json": ev.text})]


def _object(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
