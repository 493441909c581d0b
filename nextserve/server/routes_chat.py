"""POST /v1/chat/completions: the chat template, tool calls (whole or as streamed deltas), logprobs, n."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from ..engine.outputs import RequestOutput
from . import protocol as P
from .body import parse_body
from .checks import check_chat, check_common, check_length, sampling_params, with_reasoning_default
from .constraints import output_constraint
from .errors import bad, validation_error
from .generation import Generation, finite
from .reasoning import ReasoningSplitter, reasoning_opened, split_reasoning
from .render import encode_chat
from .state import ServerState
from .streaming import TextStream
from .tool_calls import (
    CallArgs,
    CallStart,
    ContentDelta,
    Event,
    ToolCallParser,
    is_json_object,
    parse_tool_calls,
)

T = TypeVar("T")


def translated_chat(srv: ServerState, build: Callable[[dict[str, Any]], T]) -> T:
    """Another dialect's request as the chat route's, `build(context)` translating it (validated as the
    chat route validates): what fails is a 400 naming the field."""
    try:
        return build({"limits": srv.limits, "max_prompt": None})
    except ValidationError as exc:  # the translated conversation fails the chat route's checks
        raise validation_error(exc.errors()) from None
    except ValueError as exc:
        raise bad(str(exc)) from None


def checked_chat(srv: ServerState, req: P.ChatCompletionRequest) -> P.ChatCompletionRequest:
    """The chat route's checks of a parsed request, then its reasoning default."""
    check_common(srv, req)
    check_chat(req)
    return with_reasoning_default(srv, req)


async def chat_prompt(
    srv: ServerState, request: Request, req: P.ChatCompletionRequest, param: str = "messages"
) -> tuple[list[int], int | None]:
    """The rendered prompt's ids and its message checkpoint (a template that rejects the chat: a 400
    naming `param`)."""
    try:
        return await srv.prep.run(request, encode_chat, srv.tokenizer, req)
    except ValueError as exc:
        raise bad(str(exc), param=param) from None


async def start_chat(
    srv: ServerState,
    request: Request,
    req: P.ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    fields: tuple[str, str] = ("messages", "max_tokens"),
    clamp: bool = False,
) -> tuple[Generation, list[int], dict[str, Any] | None]:
    """A checked chat request (also the Messages and Responses dialects', translated) queued to the engine:
    its Generation, prompt ids and the tools its answer may call, name -> parameters schema (None: no tool
    calls are parsed). `fields`: the dialect's names of the conversation and max_tokens, for errors.
    `clamp`: a max_tokens past the context's room is cut to that room (the answer then ends at the context's
    end, as a length stop) rather than refused."""
    ids, checkpoint = await chat_prompt(srv, request, req, fields[0])
    if clamp and max_tokens is not None:
        max_tokens = max(1, min(max_tokens, srv.max_context - len(ids)))
    check_length(srv, len(ids), max_tokens, *fields)
    params = sampling_params(srv, req, max_tokens, logprobs)
    tool_mode = bool(req.tools) and req.tool_choice != "none"
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if tool_mode else None
    compiled = await output_constraint(srv, request, req, tools, req.tool_choice)
    checkpoints = (checkpoint,) if checkpoint is not None else ()
    gen = Generation(srv, request, "chat", req, ids, params, compiled, checkpoints)
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or ()}
    return gen, ids, (schemas if tools else None)


async def chat_completions(srv: ServerState, request: Request) -> Response:
    async with srv.prep.admit():
        raw = await request.body()
        req = await srv.prep.run(request, parse_body, raw, P.ChatCompletionRequest, srv.limits)
        req = checked_chat(srv, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        gen, ids, names = await start_chat(srv, request, req, max_tokens, logprobs)
    opened = reasoning_opened(srv, ids)
    if req.stream:
        return gen.stream_response([_ChatChoice(gen, req, names, i, opened) for i in range(len(gen.rids))])

    def choice(out: RequestOutput, index: int) -> dict[str, Any]:
        reasoning, content = split_reasoning(out.text, opened)
        calls = []
        if names is not None:
            parsed = parse_tool_calls(content, names)
            if all(is_json_object(c.arguments) for c in parsed.calls):  # else cut short: the text as is
                content = parsed.content
                calls = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in parsed.calls
                ]
        finish = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
        lps = {"content": _logprobs(srv, out, 0, gen.visible_count(out))} if req.logprobs else None
        message = {"role": "assistant", "content": content, "tool_calls": calls}
        if opened is not None:
            message["reasoning_content"] = reasoning
        return {
            "index": index,
            "message": message,
            "logprobs": lps,
            "finish_reason": finish,
        }

    return await gen.respond(request, choice)


def _logprobs(srv: ServerState, out: RequestOutput, start: int, end: int) -> list[dict[str, Any]]:
    items = []
    for lp in (out.logprobs or [])[start:end]:
        tok, raw = srv.token_info(lp.token_id)
        top = []
        for tid, v in lp.top:
            t, b = srv.token_info(tid)
            top.append({"token": t, "logprob": finite(v), "bytes": b})
        items.append({"token": tok, "logprob": finite(lp.logprob), "bytes": raw, "top_logprobs": top})
    return items


def _event_delta(ev: Event) -> dict[str, Any]:
    if isinstance(ev, ContentDelta):
        return {"content": ev.text}
    if isinstance(ev, CallStart):
        call = {
            "index": ev.index,
            "id": ev.id,
            "type": "function",
            "function": {"name": ev.name, "arguments": ""},
        }
        return {"tool_calls": [call]}
    assert isinstance(ev, CallArgs)
    return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}


class _ChatChoice:
    """The chunks of one streamed chat choice: the role with its first token, content and tool-call deltas,
    then the finish."""

    def __init__(
        self,
        gen: Generation,
        req: P.ChatCompletionRequest,
        names: dict[str, Any] | None,
        index: int,
        opened: bool | None,
    ) -> None:
        self.gen, self.want_logprobs, self.index = gen, req.logprobs, index
        self.parser = ToolCallParser(names) if names is not None else None
        self.reasoning = ReasoningSplitter(opened) if opened is not None else None
        self.texts = TextStream(gen.params.stop)
        self.lp_sent = 0
        self.pending: list[dict[str, Any]] = []  # logprobs not sent yet
        self.opened = False

    def _chunk(
        self, delta: dict[str, Any], finish: str | None = None, out: RequestOutput | None = None
    ) -> str:
        lps, self.pending = (self.pending or None), []
        choice = {
            "index": self.index,
            "delta": delta,
            "logprobs": {"content": lps} if lps is not None else None,
            "finish_reason": finish,
        }
        return self.gen.chunk(choice, out)

    def chunks(self, out: RequestOutput) -> Iterator[str]:
        if self.want_logprobs:
            visible = self.gen.visible_count(out)
            self.pending += _logprobs(self.gen.srv, out, self.lp_sent, visible)
            self.lp_sent = max(self.lp_sent, visible)
        delta = self.texts.delta(out.text, out.finished)
        thought = ""
        if self.reasoning is not None:
            thought, delta = self.reasoning.feed(delta, out.finished)
        if self.parser is not None:
            events = self.parser.feed(delta) + (self.parser.finish() if out.finished else [])
        else:
            events = [ContentDelta(delta)] if delta else []
        deltas = ([{"reasoning_content": thought}] if thought else []) + [_event_delta(ev) for ev in events]
        if not self.opened:
            # NOTE: the role comes with the first token (as vLLM sends it), so a client that times the
            # first chunk measures the prefill.
            self.opened = True
            if deltas and "content" in deltas[0]:
                deltas[0] = {"role": "assistant"} | deltas[0]
            else:
                deltas.insert(0, {"role": "assistant", "content": ""})
        for d in deltas:
            yield self._chunk(d, out=out)

    def final(self, out: RequestOutput) -> str:
        called = self.parser is not None and self.parser.calls
        finish = "tool_calls" if called and out.finish_reason == "stop" else out.finish_reason
        return self._chunk({}, finish, out)
