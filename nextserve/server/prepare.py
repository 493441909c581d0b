"""Work a request needs before the engine takes it (reading the body, the chat template, tokenizing,
grammar compiles): off the event loop, on bounded thread pools, counted with the engine's waiting requests
against --max-pending, and dropped when the client leaves.

# NOTE: a job that has not started when its client leaves never runs; one that has started runs to its end
# (a thread cannot be stopped) and its result is dropped. Every job's cost is bounded by the request
# limits (limits.py), so that is bounded too. A grammar compile's --grammar-timeout counts from when it
# starts, so requests that wait for a free compiler thread are not blamed for the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request

from .errors import APIError

T = TypeVar("T")


class ClientGone(Exception):
    """The client left before its request reached the engine."""


class GrammarTimeout(Exception):
    """A grammar compile ran past its time limit."""


def queue_full(detail: str) -> APIError:
    return APIError(
        503,
        f"The server is overloaded: {detail}. Retry shortly.",
        "server_overloaded",
        code="queue_full",
        headers={"Retry-After": "1"},
    )


class Preparer:
    """The server's pre-admission work: `admit` counts a request in, `run` runs its jobs."""

    def __init__(self, num_waiting: Callable[[], int], max_pending: int, workers: int = 4) -> None:
        self.num_waiting, self.max_pending = num_waiting, max_pending
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="nextserve-prepare")
        self.compilers = ThreadPoolExecutor(2, thread_name_prefix="nextserve-grammar")
        self.active = 0  # requests between arrival and the engine's queue (event-loop only)

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Counts a request in for as long as it is prepared; a 503 when requests being prepared and
        those waiting in the engine already reach --max-pending."""
        waiting = self.active + self.num_waiting()
        if waiting >= self.max_pending:
            raise queue_full(f"{waiting} requests already wait (--max-pending {self.max_pending})")
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1

    async def run(self, request: Request, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on a preparation thread; raises ClientGone when the client leaves first."""
        return await self._run(request, self.pool, None, fn, *args)

    async def compile(self, request: Request, timeout_s: float, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on a compiler thread, at most timeout_s from its start (GrammarTimeout)."""
        return await self._run(request, self.compilers, timeout_s, fn, *args)

    async def _run(self, request: Request, pool, timeout_s: float | None, fn, *args) -> Any:
        loop = asyncio.get_running_loop()
        started = asyncio.Event()

        def job() -> Any:
            loop.call_soon_threadsafe(started.set)
            return fn(*args)

        done = loop.run_in_executor(pool, job)
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        start = asyncio.ensure_future(started.wait())
        try:
            await asyncio.wait({done, gone, start}, return_when=asyncio.FIRST_COMPLETED)
            if not (done.done() or gone.done()):
                await asyncio.wait({done, gone}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if done.done():
                return done.result()
            done.cancel()
            if gone.done():
                raise ClientGone
            raise GrammarTimeout
        finally:
            gone.cancel()
            start.cancel()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.compilers.shutdown(wait=False, cancel_futures=True)


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone (call only once the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
