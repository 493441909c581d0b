"""The Qwen-style `<tool_call>` parser of a chat answer, in both forms Qwen templates render.

JSON form: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`. XML form (Qwen3-Coder's
template, vLLM's `qwen3_coder` parser): `<tool_call>\\n<function=f>\\n<parameter=city>\\nOslo\\n</parameter>
\\n</function>\\n</tool_call>`; its values are raw text, typed by the tool's JSON schema (`typed_value`), and
the arguments are given as the JSON object they make, one parameter at a time. Both forms are read
whichever the template renders (`--tool-call-format` picks the one a constrained answer is made to
write). The JSON form is read with a scanner that knows JSON strings, so an argument that contains the
text `</tool_call>` (or braces) never ends a call early. The parser is incremental: feed it text as it is
generated and it gives content deltas and tool-call deltas (name first, then argument fragments), which
is how the stream is built. A whole response is parsed by the same code in one feed, so streamed and
non-streamed answers always agree.

A call that names a function the request did not declare is not a tool call: its text is content (the
model made it up; an agent would otherwise run whatever the name says).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from .tool_call_scan import (
    HEAD_FAIL,
    HEAD_PARTIAL,
    WS,
    JsonScanner,
    match_head,
    partial_suffix,
    typed_value,
)

TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAM_START, PARAM_END = "<parameter=", "</parameter>"
MAX_XML_NAME = 256  # characters of a function or parameter name before the call is not one


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


class ToolCallParser:
    """Incremental parser of a response that may hold `<tool_call>` blocks calling `names` (any name when
    None)."""

    def __init__(self, names: Collection[str] | None = None, schemas: dict[str, Any] | None = None) -> None:
        self.names = names
        # tool name -> its parameters schema (types the XML form's values); names given as a dict are that
        self.schemas = schemas if schemas is not None else (names if isinstance(names, dict) else {})
        self.first_param, self.param = True, ""  # the XML form's place in its call
        self.buf = ""
        self.state = "content"  # content | head | args | tail | end | fallback
        self.calls: list[ParsedCall] = []
        self.raw = ""  # text consumed since the current <tool_call>, for giving it back as content
        self.pending_ws = ""  # trailing whitespace of the content, dropped if a tool call follows
        self.held_ws = ""  # that whitespace while what follows it may still be a call
        self.after_call = False  # the next content follows a tool call: drop the whitespace between
        self.scanner: JsonScanner | None = None
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
        while self.state in ("head", "fallback", "xml_name"):  # an unfinished call start is content after all
            self._give_back(events)
            while self._step(events):
                pass
        if self.state == "content":
            self._content(self.buf, events)
        elif self.state == "args" and self.value:
            self._emit_value(events)
        elif self.state == "end":
            rest = self.buf.strip(WS)
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
                self.held_ws, self.pending_ws = self.pending_ws, ""  # dropped if a call follows
                self.buf = self.buf[i + len(TOOL_START) :]
                self.raw = TOOL_START
                self.state = "head"
                return True
            keep = partial_suffix(self.buf, TOOL_START)
            self._content(self.buf[: len(self.buf) - keep], events)
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        if self.state == "head":
            stripped = self.buf.lstrip(WS)
            if stripped.startswith(FUNCTION_START):
                self.raw += self.buf[: len(self.buf) - len(stripped) + len(FUNCTION_START)]
                self.buf = stripped[len(FUNCTION_START) :]
                self.state = "xml_name"
                return True
            if stripped and FUNCTION_START.startswith(stripped):
                return False
            m = match_head(self.buf)
            if m == HEAD_PARTIAL:
                return False
            if m == HEAD_FAIL:
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
            self.scanner, self.value = JsonScanner(), ""
            self.state = "args"
            return True
        if self.state == "args":
            assert self.scanner is not None
            if self.scanner.kind == "":
                stripped = self.buf.lstrip(WS)
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
            self.scanner = JsonScanner(depth=1)  # the rest of the call object
            self.state = "tail"
            return True
        if self.state == "tail":
            assert self.scanner is not None
            stripped = self.buf.lstrip(WS)
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
            stripped = self.buf.lstrip(WS)
            if stripped.startswith(TOOL_END):
                self.buf = stripped[len(TOOL_END) :]
            elif TOOL_END.startswith(stripped):
                return False  # (part of) the closing tag may still come
            # Without a closing tag the call ends here all the same, and the rest is content.
            self.state, self.after_call = "content", True
            return True
        if self.state == "fallback":
            return self._fallback(events)
        if self.state.startswith("xml_"):
            return self._xml(events)
        raise AssertionError(self.state)

    def _xml(self, events: list[Event]) -> bool:
        """The XML form, from after `<function=`."""
        if self.state == "xml_name":
            i = self.buf.find(">")
            if i < 0:
                if len(self.buf) > MAX_XML_NAME or "\n" in self.buf:
                    self._give_back(events)
                    return True
                return False
            name = self.buf[:i].strip()
            if not name or "\n" in self.buf[:i] or not self._declared(name):
                self._give_back(events)
                return True
            call = ParsedCall(new_call_id(), name)
            self.calls.append(call)
            events.append(CallStart(len(self.calls) - 1, call.id, name))
            self.buf, self.raw = self.buf[i + 1 :], ""
            self.state, self.first_param = "xml_params", True
            return True
        if self.state == "xml_params":
            stripped = self.buf.lstrip(WS)
            if stripped.startswith(PARAM_START):
                i = stripped.find(">")
                if i < 0:
                    if len(stripped) > MAX_XML_NAME + len(PARAM_START):
                        return self._xml_close(events, stripped)
                    return False
                self.param = stripped[len(PARAM_START) : i].strip()
                self.buf, self.state = stripped[i + 1 :], "xml_value"
                return True
            if stripped.startswith(FUNCTION_END):
                return self._xml_close(events, stripped[len(FUNCTION_END) :])
            if not stripped or PARAM_START.startswith(stripped) or FUNCTION_END.startswith(stripped):
                return False
            return self._xml_close(events, stripped)  # neither: the call ends here, the rest is content
        assert self.state == "xml_value"
        i = self.buf.find(PARAM_END)
        if i < 0:
            return False
        value = self.buf[:i]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        schema = self.schemas.get(self.calls[-1].name) or {}
        prop = (schema.get("properties") or {}).get(self.param) if isinstance(schema, dict) else None
        piece = ("{" if self.first_param else ", ") + json.dumps(self.param) + ": " + typed_value(value, prop)
        self.first_param = False
        self.calls[-1].arguments += piece
        events.append(CallArgs(len(self.calls) - 1, piece))
        self.buf, self.state = self.buf[i + len(PARAM_END) :], "xml_params"
        return True

    def _xml_close(self, events: list[Event], rest: str) -> bool:
        """The call's arguments object closed; `rest` is what follows `</function>` (or the text that
        ended the call without one)."""
        piece = "{}" if self.first_param else "}"
        self.calls[-1].arguments += piece
        events.append(CallArgs(len(self.calls) - 1, piece))
        self.buf, self.state = rest, "end"
        return True

    def _fallback(self, events: list[Event]) -> bool:
        """A call that does not start `{"name": ..., "arguments": ...`: read its whole object first."""
        if self.scanner is None:
            stripped = self.buf.lstrip(WS)
            if not stripped:
                return False
            if stripped[0] != "{":
                self._give_back(events)
                return True
            self.raw += self.buf[: len(self.buf) - len(stripped)]
            self.buf = stripped
            self.scanner = JsonScanner()
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
        # NOTE: emit the start tag now so the content state does not read it as a tool call again
        # (after the whitespace before it, held back while it looked like a call).
        self.pending_ws, self.held_ws = self.held_ws, ""
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
        body = text.rstrip(WS)
        if not body:
            self.pending_ws += text
            return
        lead = self.pending_ws
        if self.after_call:
            lead, body = "", body.lstrip(WS)
        events.append(ContentDelta(lead + body))
        self.after_call = False
        self.pending_ws = text[len(text.rstrip(WS)) :]


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


def parse_tool_calls(
    text: str, names: Collection[str] | None = None, schemas: dict[str, Any] | None = None
) -> ParsedResponse:
    """A whole response: its content (None when empty) and its calls of `names` (any when None)."""
    parser = ToolCallParser(names, schemas)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return ParsedResponse(content or None, parser.calls)


def is_json_object(arguments: str) -> bool:
    """Whether a call's arguments are a whole JSON object (a call cut short by max_tokens is not)."""
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False
