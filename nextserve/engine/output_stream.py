"""One client's outputs, handed from the engine thread to an event loop as deltas.

The engine thread pushes each step's new tokens (RequestOutput deltas, `offset` naming where they start);
while the reader has not taken them they merge into one pending delta per request, so a slow reader costs
memory in what it has not read, never a copy of the output per step. The reader keeps the cumulative
outputs. A stream may carry several engine requests (the `n` choices of one API request).
"""

from __future__ import annotations

import asyncio
import threading

from .outputs import RequestOutput

# NOTE: what a reader may leave unread before its requests are aborted: tokens plus their top-logprob
# entries (a token with 20 alternatives counts 21). About 30 MB of Python objects at the worst.
MAX_UNREAD = 1 << 18


class OutputStream:
    """Outputs of one client's engine requests: `push` on the engine thread, `next` on the client's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_unread: int = MAX_UNREAD) -> None:
        self.loop, self.max_unread = loop, max_unread
        self.request_ids: list[str] = []
        self.outputs: dict[str, RequestOutput] = {}  # cumulative, the reader's own
        self.overflowed = False  # the reader fell too far behind and its requests were aborted
        self._mu = threading.Lock()
        self._pending: dict[str, RequestOutput] = {}
        self._unread = 0
        self._wake = asyncio.Event()
        self._wake_scheduled = False

    # ---- the engine thread --------------------------------------------------------------------------
    def push(self, delta: RequestOutput) -> bool:
        """Merge a delta into what the reader has not taken; False once the reader is too far behind."""
        with self._mu:
            old = self._pending.get(delta.request_id)
            self._pending[delta.request_id] = delta if old is None else _merge(old, delta)
            self._unread += _cost(delta)
            behind = self._unread > self.max_unread
            wake, self._wake_scheduled = not self._wake_scheduled, True
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the client's loop is gone
                pass
        return not behind

    # ---- the reader ---------------------------------------------------------------------------------
    async def next(self, timeout: float | None = None) -> list[RequestOutput] | None:
        """The cumulative outputs that changed since the last call (None after `timeout` s of quiet)."""
        if timeout is None:
            await self._wake.wait()
        else:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                return None
        with self._mu:
            pending, self._pending, self._unread = self._pending, {}, 0
            self._wake.clear()
            self._wake_scheduled = False
        changed = []
        for rid, delta in pending.items():
            out = self.outputs.get(rid)
            self.outputs[rid] = out = delta if out is None else _merge(out, delta)
            changed.append(out)
        return changed

    @property
    def finished(self) -> bool:
        return all(rid in self.outputs and self.outputs[rid].finished for rid in self.request_ids)


def _cost(delta: RequestOutput) -> int:
    n = len(delta.token_ids)
    return n + sum(len(lp.top) for lp in delta.logprobs or ())


def _merge(into: RequestOutput, delta: RequestOutput) -> RequestOutput:
    """`into` extended in place by the delta that follows it (its tokens start where into's end)."""
    assert delta.offset == into.offset + len(into.token_ids), (delta.offset, into.offset, len(into.token_ids))
    into.token_ids.extend(delta.token_ids)
    if delta.logprobs is not None:
        if into.logprobs is None:
            into.logprobs = []
        into.logprobs.extend(delta.logprobs)
    into.text, into.finish_reason, into.finished = delta.text, delta.finish_reason, delta.finished
    into.cached_tokens, into.error = delta.cached_tokens, delta.error
    if into.prompt is None:
        into.prompt = delta.prompt
    return into
