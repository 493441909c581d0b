"""AsyncEngine: the engine's step loop on its own thread, with an async stream of outputs per request."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from ..config import EngineConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling import SamplingParams

log = logging.getLogger("nextserve.async_engine")


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None) -> None:
        self.engine = engine if engine is not None else LLMEngine(config)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        # NOTE: one lock guards the engine: the step loop holds it for a step, request calls for a
        # moment, so adds and aborts land between steps and never inside one.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="nextserve-engine", daemon=True)
        self._thread.start()

    # ---- the step loop (engine thread) ---------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.engine.has_unfinished():
                    self._wake.wait()
                if self._stopping and not self.engine.has_unfinished():
                    return
                try:
                    outputs = self.engine.step()
                except Exception:  # noqa: BLE001 - keep serving; the step already failed its requests
                    log.exception("engine step raised")
                    outputs = []
            for out in outputs:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        target = self._streams.get(out.request_id)
        if target is None:
            return
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, out)
        except RuntimeError:  # the client's loop is gone
            pass
        if out.finished:
            self._streams.pop(out.request_id, None)

    # ---- requests (any thread / event loop) ----------------------------------------------------
    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, constraint=None
    ) -> asyncio.Queue:
        """Admits the request to the queue (raises ValueError / QueueFull at once) and returns the
        queue its outputs arrive on. Must be called from the event loop that will read them."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._wake:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
            try:
                self.engine.add_request(prompt, params, request_id, constraint)
            except Exception:
                self._streams.pop(request_id, None)
                raise
            self._wake.notify()
        return queue

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, constraint=None
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs as they grow; the last one has finished=True. Leaving early aborts."""
        queue = self.add_request(prompt, params, request_id, constraint)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)
            # NOTE: step() forgets finished sequences; run a drain now so the slot and pages are
            # back before abort returns, not at the next step.
            self.engine.drain_finished([])

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self.engine.stats()

    def shutdown(self, abort_running: bool = True, timeout: float = 30.0) -> None:
        with self._wake:
            self._stopping = True
            if abort_running:
                for rid in list(self.engine.sequences):
                    self.engine.abort(rid)
                for out in self.engine.drain_finished([]):
                    self._deliver(out)
            self._wake.notify_all()
        self._thread.join(timeout)
