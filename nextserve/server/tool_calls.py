"""The Qwen-style `<tool_call>` parser of a chat answer.

The model writes a tool call as `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`. The parser
reads the JSON with a scanner that knows JSON strings, so an argument that contains the text
`</tool_call>` (or braces) never ends a call early. It is incremental: feed it text as it is generated and
it gives content deltas and tool-call deltas (name first, then argument fragments), which is how the
stream is built. A whole response is parsed by the same code in one feed, so streamed and non-streamed
answers always agree.

A call that names a function the request did not declare is not a tool call: its text is content (the
model made it up; an agent would otherwise run whatever the name says).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field

TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"


# ---- tool-call parsing -------------------------------------------------------------------------------


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ContentDelta:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class CallArgs:
    index: int
    text: str


Event = ContentDelta | CallStart | CallArgs

_WS = " \t\r\n"
_HEAD_PARTIAL, _HEAD_FAIL = "partial", "fail"


def _match_head(s: str) -> tuple[int, str] | str:
    """Matches `ws { ws "name" ws : ws "NAME" ws , ws "arguments" ws :` at the start of s.

    Returns (end, name) on a match, "partial" when s may still grow into one, "fail" when it cannot.
    """
    pos, n, name = 0, len(s), ""
    steps: list[str | None] = [None, "{", None, '"name"', None, ":", None, "", None, ",", None]
    steps += ['"arguments"', None, ":"]
    for step in steps:
        if step is None:  # optional whitespace
            while pos < n and s[pos] in _WS:
                pos += 1
            if pos == n:
                return _HEAD_PARTIAL
        elif step == "":  # a JSON string: the function name
            if s[pos] != '"':
                return _HEAD_FAIL
            end, esc = pos + 1, False
            while end < n:
                c = s[end]
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    break
                elif c in "\r\n":
                    return _HEAD_FAIL
                end += 1
            if end >= n:
                return _HEAD_PARTIAL
            try:
                name = json.loads(s[pos : end + 1])
            except json.JSONDecodeError:
                return _HEAD_FAIL
            pos = end + 1
        else:
            got = s[pos : pos + len(step)]
            if got != step:
                return _HEAD_PARTIAL if step.startswith(got) and pos + len(got) == n else _HEAD_FAIL
            pos += len(step)
    return pos, name


class _JsonScanner:
    """Finds where one JSON value ends, one character at a time, without parsing it."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth  # > 0: already inside a container (the rest of an object)
        self.kind = "container" if depth else ""  # "", "container", "string", "scalar"
        self.in_str = False
        self.esc = False
        self.done = False

    def feed(self, text: str) -> int:
        """Consumes characters of the value; returns how many (a scalar's delimiter is not consumed)."""
        for i, c in enumerate(text):
            if self.kind == "":
                if c in "{[":
                    self.kind, self.depth = "container", 1
                elif c == '"':
                    self.kind, self.in_str = "string", True
                else:
                    self.kind = "scalar"
                continue
            if self.kind == "scalar":
                if c in _WS or c in ",}]":
                    self.done = True
                    return i
                continue
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    if self.kind == "string":
                        self.done = True
                        return i + 1
                continue
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class ToolCallParser:
    """Incremental parser of a response that may hold `<tool_call>` blocks calling `names` (any name when
    None)."""

    def __init__(self, names: Collection[str] | None = None) -> None:
        self.names = names
        self.buf = ""
        self.state = "content"  # content | head | args | tail | end | fallback
        self.calls: list[ParsedCall] = []
        self.raw = ""  # text consumed since the current <tool_call>, for giving it back as content
        self.pending_ws = ""  # trailing whitespace of the content, dropped if a tool call follows
        self.after_call = False  # the next content follows a tool call: drop the whitespace between
        self.scanner: _JsonScanner | None = None
        self.value = ""  # a string- or scalar-valued arguments field, until it is complete

    # -- public ---------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self.buf += text
        events: list[Event] = []
        while self._step(events):
            pass
        return _coalesce(events)

    def finish(self) -> list[Event]:
        """The stream ended: flush what is held back."""
        events: list[Event] = []
        while self.state in ("head", "fallback"):  # an unfinished call start is content after all
            self._give_back(events)
            while self._step(events):
                pass
        if self.state == "content":
            self._content(self.buf, events)
        elif self.state == "args" and self.value:
            self._emit_value(events)
        elif self.state == "end":
            rest = self.buf.strip(_WS)
            if rest and not TOOL_END.startswith(rest):
                self._content(self.buf, events)
        self.buf = ""
        if not self.calls and self.pending_ws:
            events.append(ContentDelta(self.pending_ws))
        self.pending_ws = ""
        return _coalesce(events)

    # -- the state machine ----------------------------------------------------------------------------
    def _step(self, events: list[Event]) -> bool:
        """Advances as far as the buffer allows; True when it should be called again."""
        if self.state == "content":
            i = self.buf.find(TOOL_START)
            if i >= 0:
                self._content(self.buf[:i], events)
                self.pending_ws = ""
                self.buf = self.buf[i + len(TOOL_START) :]
                self.raw = TOOL_START
                self.state = "head"
                return True
            keep = _partial_suffix(self.buf, TOOL_START)
            self._content(self.buf[: len(self.buf) - keep], events)
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        if self.state == "head":
            m = _match_head(self.buf)
            if m == _HEAD_PARTIAL:
                return False
            if m == _HEAD_FAIL:
                self.state = "fallback"
                self.scanner = None
                return True
            end, name = m  # type: ignore[misc]
            if not self._declared(name):
                self._give_back(events)
                return True
            call = ParsedCall(new_call_id(), name)
            self.calls.append(call)
            events.append(CallStart(len(self.calls) - 1, call.id, name))
            self.raw += self.buf[:end]
            self.buf = self.buf[end:]
            self.scanner, self.value = _JsonScanner(), ""
            self.state = "args"
            return True
        if self.state == "args":
            assert self.scanner is not None
            if self.scanner.kind == "":
                stripped = self.buf.lstrip(_WS)
                if not stripped:
                    self.buf = ""
                    return False
                self.buf = stripped
            n = self.scanner.feed(self.buf)
            piece, self.buf = self.buf[:n], self.buf[n:]
            if self.scanner.kind == "container":
                if piece:
                    self.calls[-1].arguments += piece
                    events.append(CallArgs(len(self.calls) - 1, piece))
            else:
                self.value += piece
            if not self.scanner.done:
                return False
            if self.scanner.kind != "container":
                self._emit_value(events)
            self.scanner = _JsonScanner(depth=1)  # the rest of the call object
            self.state = "tail"
            return True
        if self.state == "tail":
            assert self.scanner is not None
            stripped = self.buf.lstrip(_WS)
            if self.scanner.depth == 1 and not self.scanner.in_str and stripped[:1] == "<":
                self.state = "end"  # the closing brace is missing; the closing tag ends the call
                return True
            n = self.scanner.feed(self.buf)
            self.buf = self.buf[n:]
            if not self.scanner.done:
                return False
            self.state = "end"
            return True
        if self.state == "end":
            stripped = self.buf.lstrip(_WS)
            if stripped.startswith(TOOL_END):
                self.buf = stripped[len(TOOL_END) :]
            elif TOOL_END.startswith(stripped):
                return False  # (part of) the closing tag may still come
            # Without a closing tag the call ends here all the same, and the rest is content.
            self.state, self.after_call = "content", True
            return True
        if self.state == "fallback":
            return self._fallback(events)
        raise AssertionError(self.state)

    def _fallback(self, events: list[Event]) -> bool:
        """A call that does not start `{"name": ..., "arguments": ...`: read its whole object first."""
        if self.scanner is None:
            stripped = self.buf.lstrip(_WS)
            if not stripped:
                return False
            if stripped[0] != "{":
                self._give_back(events)
                return True
            self.raw += self.buf[: len(self.buf) - len(stripped)]
            self.buf = stripped
            self.scanner = _JsonScanner()
        n = self.scanner.feed(self.buf)
        self.raw += self.buf[:n]
        self.buf = self.buf[n:]
        if not self.scanner.done:
            return False
        obj_text = self.raw[self.raw.index("{", len(TOOL_START)) :]
        try:
            obj = json.loads(obj_text)
        except json.JSONDecodeError:
            obj = None
        args_key = "arguments" if isinstance(obj, dict) and "arguments" in obj else "parameters"
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and args_key in obj):
            self._give_back(events)
            return True
        if not self._declared(obj["name"]):
            self._give_back(events)
            return True
        args = obj[args_key]
        call = ParsedCall(new_call_id(), obj["name"], args if isinstance(args, str) else json.dumps(args))
        self.calls.append(call)
        events.append(CallStart(len(self.calls) - 1, call.id, call.name))
        events.append(CallArgs(len(self.calls) - 1, call.arguments))
        self.scanner = None
        self.state = "end"
        return True

    def _declared(self, name: str) -> bool:
        return self.names is None or name in self.names

    def _give_back(self, events: list[Event]) -> None:
        """What looked like a tool call is not one: its text is content after all."""
        text = self.raw + self.buf
        self.raw, self.scanner = "", None
        # NOTE: emit the start tag now so the content state does not read it as a tool call again.
        self._content(TOOL_START, events)
        self.buf = text[len(TOOL_START) :]
        self.state = "content"

    def _emit_value(self, events: list[Event]) -> None:
        raw, self.value = self.value, ""
        text = raw
        if raw.startswith('"'):
            try:
                text = json.loads(raw)
            except json.JSONDecodeError:
                text = raw
        self.calls[-1].arguments += text
        events.append(CallArgs(len(self.calls) - 1, text))

    def _content(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        body = text.rstrip(_WS)
        if not body:
            self.pending_ws += text
            return
        lead = self.pending_ws
        if self.after_call:
            lead, body = "", body.lstrip(_WS)
        events.append(ContentDelta(lead + body))
        self.after_call = False
        self.pending_ws = text[len(text.rstrip(_WS)) :]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _coalesce(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + ev.text)
        elif isinstance(ev, CallArgs) and isinstance(last, CallArgs) and last.index == ev.index:
            out[-1] = CallArgs(ev.index, last.text + ev.text)
        elif isinstance(ev, ContentDelta) and not ev.text:
            continue
        else:
            out.append(ev)
    return out


@dataclass
class ParsedResponse:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def parse_tool_calls(text: str, names: Collection[str] | None = None) -> ParsedResponse:
    """A whole response: its content (None when empty) and its calls of `names` (any when None)."""
    parser = ToolCallParser(names)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return ParsedResponse(content or None, parser.calls)
