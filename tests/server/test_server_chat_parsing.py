"""The `<tool_call>` parser on crafted text: whole, and fed in every kind of piece."""

from __future__ import annotations

import json
import random

import pytest

from nextserve.server.tool_calls import CallArgs, CallStart, ContentDelta, ToolCallParser, parse_tool_calls


def call(name: str, args: dict | str, raw_args: str | None = None) -> str:
    a = raw_args if raw_args is not None else (args if isinstance(args, str) else json.dumps(args))
    return f'<tool_call>\n{{"name": "{name}", "arguments": {a}}}\n</tool_call>'


CASES = [
    # (text, content, [(name, arguments)])
    ("Just text.", "Just text.", []),
    ("Trailing newline kept when no call\n", "Trailing newline kept when no call\n", []),
    ("", None, []),
    (call("get_weather", {"city": "Paris"}), None, [("get_weather", '{"city": "Paris"}')]),
    (
        "Let me look.\n" + call("f", {"x": 1}),
        "Let me look.",
        [("f", '{"x": 1}')],
    ),
    (
        call("a", {"x": 1}) + "\n" + call("b", {"y": [1, 2]}),
        None,
        [("a", '{"x": 1}'), ("b", '{"y": [1, 2]}')],
    ),
    # The closing tag, braces, quotes and backslashes inside JSON strings do not end the call.
    (
        call("write", {"text": 'a </tool_call> b } { "q" \\ <tool_call>'}),
        None,
        [("write", json.dumps({"text": 'a </tool_call> b } { "q" \\ <tool_call>'}))],
    ),
    # Unicode and nested containers.
    (
        call("u", {"s": "héllo ✓", "n": {"m": [{"k": None}]}}),
        None,
        [("u", json.dumps({"s": "héllo ✓", "n": {"m": [{"k": None}]}}))],
    ),
    # Arguments given as a JSON-encoded string.
    ('<tool_call>\n{"name": "s", "arguments": "{\\"q\\": 1}"}\n</tool_call>', None, [("s", '{"q": 1}')]),
    # Keys in the other order: read whole, then parsed.
    ('<tool_call>\n{"arguments": {"x": 1}, "name": "rev"}\n</tool_call>', None, [("rev", '{"x": 1}')]),
    # "parameters" instead of "arguments".
    ('<tool_call>{"name": "p", "parameters": {"x": 2}}</tool_call>', None, [("p", '{"x": 2}')]),
    # Compact spacing, no newlines.
    ('<tool_call>{"name":"c","arguments":{}}</tool_call>', None, [("c", "{}")]),
    # Text after the calls is content.
    (call("f", {}) + "\nDone.", "Done.", [("f", "{}")]),
    # Not a tool call: given back as content, exactly.
    ("<tool_call> not json </tool_call> ok", "<tool_call> not json </tool_call> ok", []),
    ('<tool_call>{"foo": 1}</tool_call>', '<tool_call>{"foo": 1}</tool_call>', []),
    ("a < b, <tool and <tool_call", "a < b, <tool and <tool_call", []),
    ("x <tool_ca", "x <tool_ca", []),
    # Truncated (max_tokens): the call keeps the arguments written so far.
    ('<tool_call>\n{"name": "trunc", "arguments": {"x": "abc', None, [("trunc", '{"x": "abc')]),
    # Missing closing brace: the closing tag still ends the call.
    ('<tool_call>\n{"name": "nb", "arguments": {"x": 1}\n</tool_call>after', "after", [("nb", '{"x": 1}')]),
    # Missing closing tag.
    ('<tool_call>\n{"name": "nt", "arguments": {"x": 1}}', None, [("nt", '{"x": 1}')]),
]


def _run(text: str, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list]:
    parser = ToolCallParser()
    events = []
    for p in pieces:
        events += parser.feed(p)
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta)) or None
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, CallStart):
            assert e.index not in calls and e.id.startswith("call_")
            calls[e.index] = [e.name, ""]
        elif isinstance(e, CallArgs):
            calls[e.index][1] += e.text
    return content, [tuple(v) for _, v in sorted(calls.items())], events


@pytest.mark.parametrize(("text", "content", "calls"), CASES, ids=[str(i) for i in range(len(CASES))])
def test_parse_whole(text, content, calls):
    parsed = parse_tool_calls(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls


@pytest.mark.parametrize(("text", "content", "calls"), CASES, ids=[str(i) for i in range(len(CASES))])
def test_parse_in_pieces_agrees(text, content, calls):
    rng = random.Random(0)
    splits = [list(text)]  # one character at a time
    for _ in range(30):
        pieces, i = [], 0
        while i < len(text):
            k = rng.randint(1, 7)
            pieces.append(text[i : i + k])
            i += k
        splits.append(pieces)
    for pieces in splits:
        got_content, got_calls, _ = _run(text, pieces)
        assert got_content == content
        assert got_calls == calls


def test_name_comes_before_arguments_and_arguments_stream():
    text = call("get_weather", {"city": "Paris", "days": [1, 2, 3]})
    _, _, events = _run(text, list(text))
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "CallStart"
    # Argument fragments arrive as the text does, not all at the end.
    assert kinds.count("CallArgs") > 5


def test_held_back_tag_prefix_is_released():
    parser = ToolCallParser()
    assert parser.feed("Hello <tool") == [ContentDelta("Hello")]
    assert parser.feed("box>") == [ContentDelta(" <toolbox>")]
