"""POST /v1/responses, GET and DELETE /v1/responses/{id}, POST /v1/responses/input_tokens: the OpenAI
Responses dialect over the chat route's machinery (server/responses.py translates the request and keeps the
stored responses); output items and streamed events in that dialect's shapes, errors in OpenAI's."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.outputs import RequestOutput
from . import responses as R
from .answer_stream import AnswerStream
from .body import parse_body
from .errors import APIError, dialect_param, failure_error, warn_ignored
from .generation import CLIENT_GONE, Generation, failed
from .reasoning import reasoning_opened, split_reasoning
from .routes_chat import chat_prompt, checked_chat, start_chat, translated_chat
from .state import ServerState
from .streaming import KEEPALIVE, EventStream
from .tenants import TENANT_KEY
from .tool_calls import CallArgs, CallStart, ContentDelta, is_json_object, parse_tool_calls


def _tenant(request: Request) -> str:
    return request.scope.get(TENANT_KEY, "")


def _not_found(rid: str) -> APIError:
    return APIError(404, f"no stored response with id {rid!r}", "invalid_request_error", param="id")


async def _chat_of(srv: ServerState, request: Request, model: type) -> tuple[Any, Any, list]:
    raw = await request.body()
    req = await srv.prep.run(request, parse_body, raw, model, srv.limits)
    previous = None
    if req.previous_response_id is not None:
        previous = srv.responses.get(req.previous_response_id, _tenant(request))
        if previous is None:
            raise _not_found(req.previous_response_id)
    chat, conversation = translated_chat(srv, lambda context: R.chat_request(req, previous, context))
    warn_ignored(request.url.path, list(req.model_extra or {}), R.builtin_tools(req))
    return req, checked_chat(srv, chat), conversation


async def input_tokens(srv: ServerState, request: Request) -> Response:
    async with srv.prep.admit():
        _, chat, _ = await _chat_of(srv, request, R.InputTokensRequest)
        ids, _ = await chat_prompt(srv, request, chat, "input")
    return JSONResponse({"object": "response.input_tokens", "input_tokens": len(ids)})


async def retrieve(srv: ServerState, request: Request, rid: str) -> Response:
    stored = srv.responses.get(rid, _tenant(request))
    if stored is None:
        raise _not_found(rid)
    return JSONResponse(stored.body)


async def delete(srv: ServerState, request: Request, rid: str) -> Response:
    if not srv.responses.delete(rid, _tenant(request)):
        raise _not_found(rid)
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


async def create(srv: ServerState, request: Request) -> Response:
    async with srv.prep.admit():
        req, chat, conversation = await _chat_of(srv, request, R.ResponsesRequest)
        fields = ("input", "max_output_tokens")
        with dialect_param("response_format", "text.format"):
            gen, ids, names = await start_chat(
                srv, request, chat, req.max_output_tokens, None, fields, clamp=True
            )
    reply = _Reply(srv, gen, req, names, reasoning_opened(srv, ids), conversation, _tenant(request))
    if req.stream:
        return EventStream(reply.events(), on_close=gen.close, request_id=reply.id)
    outs = await gen.finished_outputs(request)
    if outs is None:
        return Response(status_code=CLIENT_GONE)
    (out,) = outs
    return JSONResponse(reply.finish(out, reply.items_of(out)), headers={"X-Request-Id": reply.id})


class _Reply:
    """One Responses answer: whole, or as the dialect's event stream; stored when the request asks."""

    def __init__(
        self, srv: ServerState, gen: Generation, req: R.ResponsesRequest, names: dict[str, Any] | None,
        opened: bool | None, conversation: list[dict[str, Any]], tenant: str,
    ) -> None:  # fmt: skip
        self.srv, self.gen, self.req, self.names, self.opened = srv, gen, req, names, opened
        self.conversation, self.tenant = conversation, tenant
        self.id, self.created = R.new_id("resp"), int(time.time())
        self.namespaces = R.namespaces(req)

    def usage(self, out: RequestOutput, reasoning: str) -> dict[str, Any]:
        n_out = len(out.token_ids)
        thought = len(self.srv.encode(reasoning)) if reasoning and self.srv.tokenizer is not None else 0
        return {
            "input_tokens": self.gen.n_prompt, "input_tokens_details": {"cached_tokens": out.cached_tokens},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": min(thought, n_out)},
            "total_tokens": self.gen.n_prompt + n_out,
        }  # fmt: skip

    def body(self, status: str, output: list, usage: dict | None, out: RequestOutput | None = None,
             error: dict | None = None) -> dict[str, Any]:  # fmt: skip
        incomplete = "max_output_tokens" if out is not None and out.finish_reason == "length" else None
        return R.response_body(self.id, self.srv.name, self.req, status, output, usage, self.created,
                               incomplete, error)  # fmt: skip

    def items_of(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The whole answer's output items: reasoning, then the text, then the function calls (a call that
        is cut short or malformed leaves the answer as text)."""
        thought, answer = (
            split_reasoning(out.text, self.opened) if self.opened is not None else (None, out.text)
        )
        items = [_reasoning_item(R.new_id("rs"), thought)] if thought else []
        text, calls = answer, []
        if self.names is not None:
            parsed = parse_tool_calls(answer, self.names)
            text, calls = parsed.content or "", parsed.calls
            if any(not is_json_object(c.arguments) for c in calls):
                text, calls = answer, []
        if text:
            items.append(_message_item(R.new_id("msg"), text))
        ns = self.namespaces
        items += [_call_item(R.new_id("fc"), c.id, c.name, c.arguments, ns.get(c.name)) for c in calls]
        if items and out.finish_reason == "length":
            items[-1]["status"] = "incomplete"  # the item max_output_tokens cut, as the API marks it
        return items

    def finish(self, out: RequestOutput, items: list[dict[str, Any]]) -> dict[str, Any]:
        """The final Response of `out` (stored when asked)."""
        reasoning = "".join(c["text"] for i in items if i["type"] == "reasoning" for c in i["content"])
        status = "incomplete" if out.finish_reason == "length" else "completed"
        body = self.body(status, items, self.usage(out, reasoning), out)
        if self.req.store:
            stored = R.Stored(body, self.conversation, R.answer_message(items), self.tenant)
            self.srv.responses.put(self.id, stored)
        return body

    async def events(self) -> AsyncIterator[str]:
        gen, seq = self.gen, _Sequence()
        answer = AnswerStream(gen.params.stop, self.opened, self.names)
        items = _Items(seq, self.namespaces)
        yield seq.event("response.created", response=self.body("in_progress", [], None))
        yield seq.event("response.in_progress", response=self.body("in_progress", [], None))
        try:
            async for out in gen.outputs():
                if out is None:
                    yield KEEPALIVE
                    continue
                if failed(out):
                    error = {"code": "server_error", "message": failure_error(out).message}
                    yield seq.event("response.failed", response=self.body("failed", items.done, None,
                                                                            error=error))  # fmt: skip
                    return
                if out.finished and out.finish_reason == "length":
                    items.cut = True
                for text in answer.write(out, items):
                    yield text
                if out.finished:
                    gen.tracker.finish(out.finish_reason)
                    body = self.finish(out, items.done)
                    kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
                    yield seq.event(kind, response=body)
                    return
        finally:
            gen.close()


class _Sequence:
    def __init__(self) -> None:
        self.n = -1

    def event(self, kind: str, **data: Any) -> str:
        self.n += 1
        return f"event: {kind}\ndata: {R.dumps({'type': kind, 'sequence_number': self.n} | data)}\n\n"


class _Items:
    """Output items as the stream opens and closes them: a reasoning item, a message item with one
    output_text part, a function_call item per call; `done` holds the closed ones, complete."""

    def __init__(self, seq: _Sequence, namespaces: dict[str, str]) -> None:
        self.seq, self.namespaces = seq, namespaces
        # NOTE: once max_output_tokens cut the answer, the item open then closes "incomplete" (a call's
        # argument deltas already sent cannot be taken back; its status says they are not whole)
        self.cut = False
        self.done: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the open item, its text gathered in place

    def _added(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.open = item
        index = len(self.done)
        shown = item | ({"content": []} if item["type"] in ("message", "reasoning") else {})
        out.append(self.seq.event("response.output_item.added", output_index=index, item=shown))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self.seq.event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))  # fmt: skip
        return out

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.done)}

    def close(self) -> list[str]:
        item, out = self.open, []
        if item is None:
            return out
        where = self._where()
        item["status"] = "incomplete" if self.cut else "completed"
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append(self.seq.event("response.reasoning_text.done", **where, content_index=0, text=text))
        elif item["type"] == "message":
            part = item["content"][0]
            done = {"content_index": 0, "text": part["text"], "logprobs": []}
            out.append(self.seq.event("response.output_text.done", **where, **done))
            out.append(self.seq.event("response.content_part.done", **where, content_index=0, part=part))
        else:
            out.append(self.seq.event("response.function_call_arguments.done", **where, name=item["name"],
                                      arguments=item["arguments"]))  # fmt: skip
        out.append(self.seq.event("response.output_item.done", output_index=where["output_index"], item=item))
        self.done.append(item)
        self.open = None
        return out

    def thinking(self, text: str) -> list[str]:
        if not text:
            return []
        out = [] if self._is("reasoning") else self._added(_reasoning_item(R.new_id("rs"), "", "in_progress"))
        self.open["content"][0]["text"] += text
        return out + [
            self.seq.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)
        ]

    def event(self, ev: Any) -> list[str]:
        if isinstance(ev, ContentDelta):
            if not ev.text:
                return []
            out = (
                [] if self._is("message") else self._added(_message_item(R.new_id("msg"), "", "in_progress"))
            )
            self.open["content"][0]["text"] += ev.text
            return out + [self.seq.event("response.output_text.delta", **self._where(), content_index=0,
                                         delta=ev.text, logprobs=[])]  # fmt: skip
        if isinstance(ev, CallStart):
            ns = self.namespaces.get(ev.name)
            return self._added(_call_item(R.new_id("fc"), ev.id, ev.name, "", ns, "in_progress"))
        assert isinstance(ev, CallArgs)
        self.open["arguments"] += ev.text
        return [self.seq.event("response.function_call_arguments.delta", **self._where(), delta=ev.text)]

    def _is(self, kind: str) -> bool:
        return self.open is not None and self.open["type"] == kind


def _reasoning_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": rid, "summary": [], "content": content, "status": status}


def _message_item(mid: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": mid, "status": status, "role": "assistant", "content": [part]}


def _call_item(
    fid: str, call_id: str, name: str, arguments: str, namespace: str | None = None, status: str = "completed"
) -> dict[str, Any]:
    item = {"type": "function_call", "id": fid, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip
    return item | ({"namespace": namespace} if namespace is not None else {})
