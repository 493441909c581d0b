"""One generation request on the engine, whichever endpoint made it: submitting it, its timing, metrics
and log line, and answering it, streamed (SSE chunks) or whole, in the envelope both endpoints share."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.outputs import RequestOutput
from ..engine.sampling import SamplingParams
from ..engine.scheduler import QueueFull
from . import protocol as P
from .errors import APIError, bad, failure_error, raise_for_failure
from .state import LOG_KEY, ServerState
from .streaming import DONE, KEEPALIVE, EventStream, outputs, sse

# kind -> (request id prefix, object of a whole answer, object of a stream chunk)
_KINDS = {
    "chat": ("chatcmpl-", "chat.completion", "chat.completion.chunk"),
    "completions": ("cmpl-", "text_completion", "text_completion"),
}


class Tracker:
    """Timing, metrics and the structured log line of one generation request."""

    def __init__(self, srv: ServerState, fields: dict[str, Any], request_id: str, prompt_tokens: int) -> None:
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


class StreamRenderer(Protocol):
    """What an endpoint streams: chunks before any output, chunks of each output, the finishing chunk."""

    def prelude(self) -> Iterable[str]: ...

    def chunks(self, out: RequestOutput) -> Iterable[str]: ...

    def final(self, out: RequestOutput) -> str: ...


class Generation:
    """A request submitted to the engine (at construction: raises APIError when it is refused)."""

    def __init__(
        self,
        srv: ServerState,
        request: Request,
        kind: str,
        req: P._SamplingFields,
        ids: list[int],
        params: SamplingParams,
        constraint,
        checkpoints: tuple[int, ...] = (),
    ) -> None:
        prefix, self.object, self.chunk_object = _KINDS[kind]
        self.srv, self.params, self.n_prompt = srv, params, len(ids)
        self.rid = prefix + uuid.uuid4().hex
        opts = req.stream_options or P.StreamOptions()
        self.include_usage = opts.include_usage
        self.continuous = opts.include_usage and opts.continuous_usage_stats
        fields = request.scope.setdefault(LOG_KEY, {})
        fields.update(endpoint=kind, stream=req.stream)
        self.tracker = Tracker(srv, fields, self.rid, len(ids))
        self.queue = self._submit(ids, constraint, checkpoints)
        self.created = int(time.time())

    def _submit(self, ids: list[int], constraint, checkpoints: tuple[int, ...]) -> asyncio.Queue:
        try:
            return self.srv.engine.add_request(ids, self.params, self.rid, constraint, checkpoints)
        except QueueFull as exc:
            raise APIError(
                503,
                f"The server is overloaded: {exc}. Retry shortly.",
                "server_overloaded",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        except ValueError as exc:
            raise bad(str(exc)) from None
        except RuntimeError as exc:
            raise APIError(
                503, f"The server is not accepting requests: {exc}", "server_error", code="unavailable"
            ) from None

    def close(self) -> None:
        """Aborts the request unless it ended (the client left)."""
        if not self.tracker.done:
            self.srv.engine.abort(self.rid)
            self.tracker.finish("client_disconnect")

    # -- bodies -----------------------------------------------------------------------------------------
    def envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = {"id": self.rid, "object": obj, "created": self.created, "model": self.srv.name}
        return body | {"choices": choices} | extra

    def usage(self, out: RequestOutput | None) -> dict[str, Any]:
        """Usage of the output, or (None) of what the stream has seen so far."""
        gen = len(out.token_ids) if out is not None else self.tracker.n
        cached = out.cached_tokens if out is not None else self.tracker.cached
        return {
            "prompt_tokens": self.n_prompt,
            "completion_tokens": gen,
            "total_tokens": self.n_prompt + gen,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def visible_count(self, out: RequestOutput) -> int:
        """Generated tokens that the text shows: all but a final stop token."""
        n = len(out.token_ids)
        if out.finished and out.finish_reason == "stop" and n:
            last, p = out.token_ids[-1], self.params
            if (last == self.srv.eos_token_id and not p.ignore_eos) or last in p.stop_token_ids:
                return n - 1
        return n

    # -- answering whole --------------------------------------------------------------------------------
    async def respond(
        self, request: Request, choice_of: Callable[[RequestOutput], dict[str, Any]]
    ) -> Response:
        try:
            out = await self._collect(request)
        except BaseException:
            self.srv.engine.abort(self.rid)
            raise
        if out is None:
            return Response(status_code=499)  # nobody is listening
        raise_for_failure(out)
        body = self.envelope(self.object, [choice_of(out)], usage=self.usage(out))
        return JSONResponse(body, headers={"X-Request-Id": self.rid})

    async def _collect(self, request: Request) -> RequestOutput | None:
        """The final output; None (and the request aborted) if the client leaves first."""

        async def drain() -> RequestOutput:
            last = None
            async for out in outputs(self.queue, None):
                self.tracker.update(out)
                last = out
            return last

        async def until_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        consume = asyncio.ensure_future(drain())
        watch = asyncio.ensure_future(until_disconnect())
        try:
            await asyncio.wait({consume, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not consume.done():
                consume.cancel()
                self.close()
            watch.cancel()
        if consume.cancelled():
            return None
        out = consume.result()
        self.tracker.finish(out.finish_reason)
        return out

    # -- streaming --------------------------------------------------------------------------------------
    def stream(self, renderer: StreamRenderer) -> EventStream:
        return EventStream(self._events(renderer), on_close=self.close, request_id=self.rid)

    def chunk(self, choice: dict[str, Any], out: RequestOutput | None) -> str:
        body = self.envelope(self.chunk_object, [choice])
        if self.include_usage:
            body["usage"] = self.usage(out) if self.continuous else None
        return sse(body)

    async def _events(self, renderer: StreamRenderer) -> AsyncIterator[str]:
        try:
            for text in renderer.prelude():
                yield text
            async for out in outputs(self.queue, self.srv.keepalive_s):
                if out is None:
                    yield KEEPALIVE
                    continue
                self.tracker.update(out)
                if out.finish_reason in ("error", "abort"):
                    self.tracker.finish(out.finish_reason)
                    yield sse(failure_error(out).body())
                    yield DONE
                    return
                for text in renderer.chunks(out):
                    yield text
                if out.finished:
                    self.tracker.finish(out.finish_reason)
                    yield renderer.final(out)
                    if self.include_usage:
                        yield sse(self.envelope(self.chunk_object, [], usage=self.usage(out)))
                    yield DONE
                    return
        finally:
            self.close()


def finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0
