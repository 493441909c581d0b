"""A streamed answer's outputs as what the dialects' event streams are made of: the text each output adds
(held back where a stop string may still cut it), split into reasoning and answer, the answer into content
and tool-call events. The Messages and Responses streams share it; each writes its own events."""

from __future__ import annotations

from typing import Any, Protocol

from ..engine.outputs import RequestOutput
from .reasoning import ReasoningSplitter
from .streaming import TextStream
from .tool_calls import ContentDelta, Event, ToolCallParser


class StreamWriter(Protocol):
    """A dialect's writer of stream events (its open block or item, closed when the next kind starts)."""

    def thinking(self, text: str) -> list[str]: ...

    def event(self, ev: Event) -> list[str]: ...

    def close(self) -> list[str]: ...


class AnswerStream:
    def __init__(self, stop: tuple[str, ...], opened: bool | None, names: dict[str, Any] | None) -> None:
        self.texts = TextStream(stop)
        self.thinking = ReasoningSplitter(opened) if opened is not None else None
        self.parser = ToolCallParser(names) if names is not None else None

    def feed(self, out: RequestOutput) -> tuple[str, list[Event]]:
        """(the reasoning text `out` adds, its answer's content and tool-call events)."""
        delta = self.texts.delta(out.text, out.finished)
        thought = ""
        if self.thinking is not None:
            thought, delta = self.thinking.feed(delta, out.finished)
        if self.parser is None:
            return thought, [ContentDelta(delta)] if delta else []
        return thought, self.parser.feed(delta) + (self.parser.finish() if out.finished else [])

    def write(self, out: RequestOutput, writer: StreamWriter) -> list[str]:
        """The stream events `out` adds, as `writer` writes them: its reasoning, its answer's events, and
        on the last output the closing of what is open."""
        thought, evs = self.feed(out)
        texts = writer.thinking(thought)
        for ev in evs:
            texts += writer.event(ev)
        return texts + (writer.close() if out.finished else [])

    @property
    def called(self) -> bool:
        """Whether the answer so far holds a tool call."""
        return self.parser is not None and bool(self.parser.calls)
