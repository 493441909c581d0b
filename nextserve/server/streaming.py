"""Server-sent events: the response that aborts on disconnect, `data:` framing, keep-alive comments, and
text deltas that hold back what a stop string may still cut off."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi.responses import StreamingResponse

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keep-alive\n\n"
GONE_KEY = "nextserve.client_gone"  # the scope key set when a stream's client left before its end


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
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
        done = False
        try:
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    nonlocal done
                    try:
                        await self.stream_response(send)
                        done = True
                    except OSError:
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(run)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            if not done:
                # NOTE: counted and logged as 499 (the middleware reads this), like a whole answer's client
                scope[GONE_KEY] = True
            self.on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


class TextStream:
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
