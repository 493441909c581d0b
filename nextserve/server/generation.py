"""One generation request on the engine, whichever endpoint made it: its `n` choices submitted as engine
requests on one output stream, its timing, metrics and log line, and answering it, streamed (SSE chunks)
or whole, in the envelope both endpoints share.

# NOTE: choice i of a request with a seed samples with seed + i (vLLM's rule), each from its own generator,
# so every choice equals the request made alone with that seed and n = 1, in any batch and any mode (C1).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import replace
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.output_stream import OutputStream
from ..engine.outputs import RequestOutput
from ..engine.sampling import SamplingParams
from ..engine.scheduler import QueueFull
from . import protocol as P
from .errors import LOG_KEY, APIError, bad, failure_error, raise_for_failure
from .prepare import queue_full, wait_for_disconnect
from .state import ServerState
from .streaming import DONE, KEEPALIVE, EventStream, sse
from .tenants import cache_salt

# kind -> (request id prefix, object of a whole answer, object of a stream chunk)
_KINDS = {
    "chat": ("chatcmpl-", "chat.completion", "chat.completion.chunk"),
    "completions": ("cmpl-", "text_completion", "text_completion"),
}
CLIENT_GONE = 499  # the status a request whose client left is counted and logged under (nginx's)


class Tracker:
    """Timing, metrics and the structured log line of one generation request (all its choices)."""

    def __init__(self, srv: ServerState, fields: dict[str, Any], request_id: str, prompt_tokens: int) -> None:
        self.srv, self.fields = srv, fields
        self.t0 = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.counts: dict[str, int] = {}  # tokens seen, per choice
        self.cached = 0
        self.prompt_tokens = prompt_tokens
        self.done = False
        fields.update(request_id=request_id, prompt_tokens=prompt_tokens)

    @property
    def n(self) -> int:
        return sum(self.counts.values())

    def update(self, out: RequestOutput) -> None:
        self.cached = max(self.cached, out.cached_tokens)
        k = len(out.token_ids) - self.counts.get(out.request_id, 0)
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
        self.last = now
        self.counts[out.request_id] = len(out.token_ids)

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


class ChoiceRenderer(Protocol):
    """What an endpoint streams of one choice: the chunks of each of its outputs (the first of which
    opens the choice: its role, or the echoed prompt), and its finishing chunk."""

    def chunks(self, out: RequestOutput) -> Iterable[str]: ...

    def final(self, out: RequestOutput) -> str: ...


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling parameters of each of n choices (choice i seeded seed + i)."""
    if n == 1 or params.seed is None:
        return [params] * n
    return [replace(params, seed=(params.seed + i) % 2**64 if i else params.seed) for i in range(n)]


class Generation:
    """A request's choices submitted to the engine (at construction: raises APIError when refused)."""

    def __init__(
        self,
        srv: ServerState,
        request: Request,
        kind: str,
        req: P._SamplingFields,
        ids: list[int],
        params: SamplingParams,
        compiled_grammar: Any = None,
        checkpoints: tuple[int, ...] = (),
    ) -> None:
        prefix, self.object, self.chunk_object = _KINDS[kind]
        self.srv, self.params, self.n_prompt = srv, params, len(ids)
        self.rid = prefix + uuid.uuid4().hex
        n = req.n or 1
        self.rids = [self.rid] if n == 1 else [f"{self.rid}-{i}" for i in range(n)]
        self.index = {rid: i for i, rid in enumerate(self.rids)}
        # NOTE: a server without a tokenizer has no text to give: its answers always carry token ids
        self.token_ids = req.return_token_ids or srv.tokenizer is None
        opts = req.stream_options or P.StreamOptions()
        self.include_usage = opts.include_usage
        self.continuous = opts.include_usage and opts.continuous_usage_stats
        fields = request.scope.setdefault(LOG_KEY, {})
        fields.update(endpoint=kind, stream=req.stream, n=n)
        self.tracker = Tracker(srv, fields, self.rid, len(ids))
        self._ids_sent: dict[str, int] = {}
        salt = cache_salt(request.scope, req.cache_salt)
        self.stream = self._submit(ids, choice_params(params, n), compiled_grammar, checkpoints, salt)
        self.created = int(time.time())

    def _submit(self, ids, params: list[SamplingParams], compiled, checkpoints, salt) -> OutputStream:
        stream = None
        try:
            for rid, p in zip(self.rids, params, strict=True):
                constraint = self.srv.grammar.constraint(compiled) if compiled is not None else None
                stream = self.srv.engine.add_request(ids, p, rid, constraint, checkpoints, stream, salt)
        except (QueueFull, ValueError, RuntimeError) as exc:
            for rid in stream.request_ids if stream is not None else ():
                self.srv.engine.abort(rid)
            if isinstance(exc, QueueFull):
                raise queue_full(str(exc)) from None
            if isinstance(exc, ValueError):
                raise bad(str(exc)) from None
            raise APIError(
                503, f"The server is not accepting requests: {exc}", "server_error", code="unavailable"
            ) from None
        return stream

    def close(self) -> None:
        """Aborts what has not ended (the client left)."""
        if not self.tracker.done:
            for rid in self.rids:
                self.srv.engine.abort(rid)
            self.tracker.finish("client_disconnect")

    # -- bodies -----------------------------------------------------------------------------------------
    def envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = {"id": self.rid, "object": obj, "created": self.created, "model": self.srv.name}
        return body | {"choices": choices} | extra

    def usage(self) -> dict[str, Any]:
        gen = sum(len(o.token_ids) for o in self.stream.outputs.values())
        cached = max((o.cached_tokens for o in self.stream.outputs.values()), default=0)
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
    async def finished_outputs(self, request: Request) -> list[RequestOutput] | None:
        """Every choice's final output (a failed one raised as its APIError); None when the client left
        (the request aborted). Anything else raised aborts the request too."""
        try:
            outs = await self._collect(request)
        except BaseException:
            self.close()
            raise
        for out in outs or ():
            raise_for_failure(out)
        return outs

    async def respond(
        self, request: Request, choice_of: Callable[[RequestOutput, int], dict[str, Any]]
    ) -> Response:
        outs = await self.finished_outputs(request)
        if outs is None:
            return Response(status_code=CLIENT_GONE)  # nobody is listening
        choices = [choice_of(out, i) for i, out in enumerate(outs)]
        if self.token_ids:
            for choice, out in zip(choices, outs, strict=True):
                choice["token_ids"] = list(out.token_ids)
        body = self.envelope(self.object, choices, usage=self.usage())
        return JSONResponse(body, headers={"X-Request-Id": self.rid})

    async def _collect(self, request: Request) -> list[RequestOutput] | None:
        """Every choice's final output, in order; None (and the request aborted) if the client leaves."""

        async def drain() -> None:
            while not self.stream.finished:
                for out in await self.stream.next():
                    self.tracker.update(out)

        consume = asyncio.ensure_future(drain())
        watch = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({consume, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not consume.done():
                consume.cancel()
        if consume not in done:
            self.close()
            return None
        consume.result()  # a failure of the drain itself
        outs = [self.stream.outputs[rid] for rid in self.rids]
        bad = [o for o in outs if failed(o)]
        self.tracker.finish(bad[0].finish_reason if bad else outs[0].finish_reason)
        return outs

    # -- streaming --------------------------------------------------------------------------------------
    def stream_response(self, renderers: list[ChoiceRenderer]) -> EventStream:
        return EventStream(self._events(renderers), on_close=self.close, request_id=self.rid)

    def chunk(self, choice: dict[str, Any], out: RequestOutput | None = None) -> str:
        """An SSE chunk of one choice; with token ids asked for, the ids of `out` not sent before."""
        if self.token_ids and out is not None:
            sent = self._ids_sent.get(out.request_id, 0)
            choice["token_ids"] = out.token_ids[sent:]
            self._ids_sent[out.request_id] = len(out.token_ids)
        body = self.envelope(self.chunk_object, [choice])
        if self.include_usage:
            body["usage"] = self.usage() if self.continuous else None
        return sse(body)

    async def outputs(self) -> AsyncIterator[RequestOutput | None]:
        """The streamed outputs as they come, the tracker updated: None after keepalive_s of quiet (time
        for a keep-alive), a failed output last (the tracker finished with it); it ends once every choice
        has finished. The dialects' event streams are built on it (each closes the generation itself)."""
        while True:
            outs = await self.stream.next(self.srv.keepalive_s)
            if outs is None:
                yield None
                continue
            for out in outs:
                self.tracker.update(out)
                if failed(out):
                    self.tracker.finish(out.finish_reason)
                    yield out
                    return
                yield out
            if self.stream.finished:
                return

    async def _events(self, renderers: list[ChoiceRenderer]) -> AsyncIterator[str]:
        try:
            async for out in self.outputs():
                if out is None:
                    yield KEEPALIVE
                elif failed(out):
                    yield sse(failure_error(out).body())
                    yield DONE
                    return
                else:
                    renderer = renderers[self.index[out.request_id]]
                    for text in renderer.chunks(out):
                        yield text
                    if out.finished:
                        yield renderer.final(out)
            self.tracker.finish(self.stream.outputs[self.rids[0]].finish_reason)
            if self.include_usage:
                yield sse(self.envelope(self.chunk_object, [], usage=self.usage()))
            yield DONE
        finally:
            self.close()


def failed(out: RequestOutput) -> bool:
    """Whether an output ended its request with an error or an abort."""
    return out.finish_reason in ("error", "abort")


def finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0
