"""AsyncEngine: the engine's step loop on its own thread, with an async stream of outputs per client.

Only the engine thread changes the engine. Callers hand it adds and aborts through an inbox that it
drains between steps, so `add_request` and `abort` never wait for a step: `add_request` makes the checks
that need no engine state at once (raising ValueError / QueueFull / RuntimeError to its caller) and
returns the request's OutputStream; a failure found later on the engine thread arrives on that stream as
a finished output with finish_reason "error". Outputs travel as deltas (engine/output_stream.py): a
client that stops reading holds only what it has not read, and one too far behind is aborted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from ..engine_config import EngineConfig
from .engine import LLMEngine
from .output_stream import MAX_UNREAD, OutputStream
from .outputs import RequestOutput
from .sampling import SamplingParams
from .scheduler import QueueFull
from .validate import check_prompt

log = logging.getLogger("nextserve.async_engine")

_ADD, _ABORT = "add", "abort"


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        engine: LLMEngine | None = None,
        max_unread: int = MAX_UNREAD,
    ) -> None:
        """`max_unread`: tokens (and their top logprobs) a client may leave unread before its requests are
        aborted (engine/output_stream.py)."""
        self.engine = engine if engine is not None else LLMEngine(config)
        self.max_unread = max_unread
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        # NOTE: two locks. The engine thread holds _step_lock while it changes the engine (a step, or
        # applying the inbox); stats() takes it for a consistent view. _mu guards the inbox, the streams
        # and the flags, and is only ever held for a moment.
        self._step_lock = threading.Lock()
        self._mu = threading.Condition()
        self._inbox: list[tuple[str, str, tuple | None]] = []
        self._pending_adds = 0  # adds sent but not yet applied: they count as waiting
        self._streams: dict[str, OutputStream] = {}
        self._stopping = False
        self._abort_all = False
        self._thread = threading.Thread(target=self._loop, name="nextserve-engine", daemon=True)
        self._thread.start()

    # ---- the step loop (engine thread) ---------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._mu:
                while not (self._inbox or self._stopping or self.engine.has_unfinished()):
                    self._mu.wait()
                inbox, self._inbox = self._inbox, []
                stopping, abort_all = self._stopping, self._abort_all
            if inbox or abort_all:
                with self._step_lock:
                    outputs = self._apply(inbox, abort_all)
                self._deliver(outputs)
            if not self.engine.has_unfinished():
                if stopping:
                    return
                continue
            with self._step_lock:
                try:
                    outputs = self.engine.step(deltas=True)
                except Exception as exc:  # noqa: BLE001 - keep serving; a step that raises ends them all
                    # NOTE: the step's own failures end their requests inside it; a raise out of it
                    # would raise again next step with the same requests, in a loop: they end here.
                    log.exception("engine step raised")
                    outputs = self.engine.fail_all(f"engine step failed: {type(exc).__name__}: {exc}", True)
            self._deliver(outputs)

    def _apply(self, inbox: list[tuple[str, str, tuple | None]], abort_all: bool) -> list[RequestOutput]:
        """Applies adds and aborts in the order they were sent. An aborted request's pages and slot are
        free before its last output is delivered."""
        failed: list[RequestOutput] = []
        for kind, rid, payload in inbox:
            if kind == _ABORT:
                self.engine.abort(rid)
                continue
            ids, text, params, constraint, checkpoints, salt = payload
            try:
                self.engine.add_request(ids, params, rid, constraint, checkpoints, salt)
                # NOTE: the prompt was tokenized on the caller's thread; keep its text for the output.
                self.engine.sequences[rid].prompt_text = text
            except Exception as exc:  # noqa: BLE001 - a refused request fails alone
                error = f"{type(exc).__name__}: {exc}"
                failed.append(
                    RequestOutput(rid, text, ids, finish_reason="error", finished=True, error=error)
                )
            finally:
                with self._mu:
                    self._pending_adds -= 1
        if abort_all:
            for rid in list(self.engine.sequences):
                self.engine.abort(rid)
        return failed + self.engine.drain_finished([], deltas=True)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._mu:
                rid = out.request_id
                stream = self._streams.pop(rid, None) if out.finished else self._streams.get(rid)
            if stream is None or stream.push(out) or out.finished or stream.overflowed:
                continue
            stream.overflowed = True
            log.info("aborting %s: its client left more than %d tokens unread", rid, stream.max_unread)
            for other in stream.request_ids:
                self.abort(other)

    # ---- requests (any thread / event loop) ----------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        constraint=None,
        checkpoints: tuple[int, ...] = (),
        stream: OutputStream | None = None,
        cache_salt: str | None = None,
    ) -> OutputStream:
        """Sends the request to the engine thread and returns the stream its outputs arrive on (`stream`,
        which may carry other requests of the same client, or a new one); raises ValueError / QueueFull /
        RuntimeError (shutting down) at once. Call it from the event loop that will read the stream."""
        if self._stopping:
            raise RuntimeError("the engine is shutting down")
        ids, text = check_prompt(self.engine, prompt)
        if stream is None:
            stream = OutputStream(asyncio.get_running_loop(), self.max_unread)
        with self._mu:
            if self._stopping or not self._thread.is_alive():
                raise RuntimeError("the engine is shutting down")
            if request_id in self._streams or request_id in self.engine.sequences:
                raise ValueError(f"request id {request_id!r} is already in use")
            waiting, limit = len(self.engine.scheduler.waiting) + self._pending_adds, self.config.max_pending
            if waiting >= limit:
                raise QueueFull(f"{waiting} requests already wait (--max-pending {limit})")
            self._streams[request_id] = stream
            stream.request_ids.append(request_id)
            self._inbox.append((_ADD, request_id, (ids, text, params, constraint, checkpoints, cache_salt)))
            self._pending_adds += 1
            self._mu.notify()
        return stream

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, constraint=None
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs as they grow; the last one has finished=True. Leaving early aborts."""
        stream = self.add_request(prompt, params, request_id, constraint)
        finished = False
        try:
            while not finished:
                for out in await stream.next():
                    finished = out.finished
                    yield out
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Ends the request between steps; returns at once. Its pages and slot are free before its stream
        gets its last output (finish_reason "abort")."""
        with self._mu:
            if request_id not in self._streams:
                return  # finished already, or never added
            self._inbox.append((_ABORT, request_id, None))
            self._mu.notify()

    def num_waiting(self) -> int:
        """Requests sent or queued that wait for admission."""
        with self._mu:
            return len(self.engine.scheduler.waiting) + self._pending_adds

    def stats(self) -> dict[str, int]:
        with self._step_lock, self._mu:
            s = self.engine.stats()
            s["waiting"] += self._pending_adds
            return s

    def failure(self) -> str | None:
        """Why the engine cannot serve any more (a pipeline stage died), or None."""
        return self.engine.failure()

    def is_alive(self) -> bool:
        """True while the engine thread runs and takes requests; False once shutdown has begun."""
        return self._thread.is_alive() and not self._stopping

    def shutdown(self, abort_running: bool = True, timeout: float = 30.0) -> None:
        """Takes no more requests; aborts the running ones (or lets them finish) and waits up to
        `timeout` seconds for the engine thread to end."""
        with self._mu:
            self._stopping = True
            self._abort_all = self._abort_all or abort_running
            self._mu.notify_all()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()  # pipeline stage processes, once no step can run any more
