"""Scanners of the tool-call parser (server/tool_calls.py): the JSON form's call head and values, found
without parsing them, and the XML form's values typed by their schema."""

from __future__ import annotations

import json
from typing import Any

WS = " \t\r\n"
HEAD_PARTIAL, HEAD_FAIL = "partial", "fail"


def match_head(s: str) -> tuple[int, str] | str:
    """Matches `ws { ws "name" ws : ws "NAME" ws , ws "arguments" ws :` at the start of s.

    Returns (end, name) on a match, "partial" when s may still grow into one, "fail" when it cannot.
    """
    pos, n, name = 0, len(s), ""
    steps: list[str | None] = [None, "{", None, '"name"', None, ":", None, "", None, ",", None]
    steps += ['"arguments"', None, ":"]
    for step in steps:
        if step is None:  # optional whitespace
            while pos < n and s[pos] in WS:
                pos += 1
            if pos == n:
                return HEAD_PARTIAL
        elif step == "":  # a JSON string: the function name
            if s[pos] != '"':
                return HEAD_FAIL
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
                    return HEAD_FAIL
                end += 1
            if end >= n:
                return HEAD_PARTIAL
            try:
                name = json.loads(s[pos : end + 1])
            except json.JSONDecodeError:
                return HEAD_FAIL
            pos = end + 1
        else:
            got = s[pos : pos + len(step)]
            if got != step:
                return HEAD_PARTIAL if step.startswith(got) and pos + len(got) == n else HEAD_FAIL
            pos += len(step)
    return pos, name


class JsonScanner:
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
                if c in WS or c in ",}]":
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


def typed_value(text: str, schema: Any) -> str:
    """An XML-form parameter value as JSON, typed by its property schema: strings as they are; integers,
    numbers, booleans and null when the text is one; an enum's or const's value when the text is one with
    whitespace around; objects, arrays and untyped values parsed as JSON when they are JSON; anything else
    a string (as vLLM's qwen3_coder parser types them)."""
    bare = text.strip()
    schema = schema if isinstance(schema, dict) else {}
    choices = schema.get("enum") or ([schema["const"]] if "const" in schema else [])
    for choice in choices:  # an enum's value, whatever whitespace surrounds it (a grammar allows some)
        if (choice if isinstance(choice, str) else json.dumps(choice)) == bare:
            return json.dumps(choice, ensure_ascii=False)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return json.dumps(text, ensure_ascii=False)
    if kind == "integer":
        try:
            return json.dumps(int(bare))
        except ValueError:
            pass
    elif kind == "number":
        try:
            value = float(bare)
            return json.dumps(int(value) if value.is_integer() and "." not in bare and "e" not in bare.lower()
                              else value)  # fmt: skip
        except ValueError:
            pass
    elif kind == "boolean" and bare.lower() in ("true", "false"):
        return bare.lower()
    elif kind == "null" and bare.lower() in ("null", "none"):
        return "null"
    elif kind in ("object", "array", None):
        try:
            return json.dumps(json.loads(bare), ensure_ascii=False)
        except ValueError:
            pass
    return json.dumps(text, ensure_ascii=False)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
