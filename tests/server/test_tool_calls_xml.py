"""The XML tool-call form (Qwen3-Coder's template, issue 20): parsed whole and streamed at every split,
values typed by the tool's schema, undeclared or unfinished calls left as text, both forms in one answer;
and through a live server, a call constrained to the XML form (--tool-call-format xml) comes back typed."""

from __future__ import annotations

import json

import pytest
from live_server import MODEL_NAME, live_server

from nextserve.server.tool_call_scan import typed_value
from nextserve.server.tool_calls import CallArgs, CallStart, ContentDelta, ToolCallParser, parse_tool_calls

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "scale": {"type": "number"},
        "opts": {"type": "object"},
        "tags": {"type": "array"},
        "any": {},
    },
}
TOOLS = {"get_weather": SCHEMA, "noop": {"type": "object"}}
CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
    '<parameter=scale>\n1.5\n</parameter>\n<parameter=opts>\n{"a": [1, 2]}\n</parameter>\n'
    '<parameter=tags>\n["x"]\n</parameter>\n<parameter=any>\n7\n</parameter>\n</function>\n</tool_call>'
)
WANT = {
    "city": "New York",
    "days": 3,
    "metric": True,
    "scale": 1.5,
    "opts": {"a": [1, 2]},
    "tags": ["x"],
    "any": 7,
}


def _streamed(text: str, cuts: list[int], names=TOOLS) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) of `text` fed in pieces cut at `cuts`."""
    parser = ToolCallParser(names)
    events, last = [], 0
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[list[str]] = []
    for e in events:
        if isinstance(e, CallStart):
            calls.append([e.name, ""])
        elif isinstance(e, CallArgs):
            calls[e.index][1] += e.text
    return content, [(n, a) for n, a in calls]


def test_whole_xml_call_typed_by_the_schema() -> None:
    parsed = parse_tool_calls("Let me check.\n" + CALL, TOOLS)
    assert parsed.content == "Let me check."
    (call,) = parsed.calls
    assert call.name == "get_weather" and json.loads(call.arguments) == WANT


def test_streamed_at_every_split_equals_whole() -> None:
    text = "Sure. " + CALL + "\n<tool_call>\n<function=noop>\n</function>\n</tool_call>"
    whole = _streamed(text, [])
    assert whole[1] == [("get_weather", json.dumps(WANT)), ("noop", "{}")]
    for cut in range(1, len(text)):
        assert _streamed(text, [cut]) == whole, cut
    assert _streamed(text, list(range(1, len(text)))) == whole  # one character at a time


def test_both_forms_in_one_answer() -> None:
    text = CALL + '\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    parsed = parse_tool_calls(text, TOOLS)
    assert [c.name for c in parsed.calls] == ["get_weather", "noop"] and parsed.content is None


@pytest.mark.parametrize(
    "text",
    [
        # undeclared:
        "<tool_call>\n<function=rm_rf>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>",
        "Checking <tool_call>\n<function=get_wea",  # cut short in the name
        "<tool_call>\n<function=\nget_weather>",  # a newline in the name
    ],
)
def test_what_is_not_a_call_stays_text(text: str) -> None:
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.calls == [] and parsed.content == text


def test_a_call_without_its_closing_tags_ends_where_the_text_stops_being_parameters() -> None:
    parsed = parse_tool_calls("<tool_call>\n<function=noop>\nthen some text", TOOLS)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("noop", "{}")]
    assert parsed.content == "then some text"
    cut = parse_tool_calls("<tool_call>\n<function=get_weather>\n<parameter=city>\nOs", TOOLS)
    assert cut.calls[0].name == "get_weather" and cut.calls[0].arguments == ""  # unfinished: no value yet


@pytest.mark.parametrize(
    "text,schema,want",
    [
        ("Oslo", {"type": "string"}, "Oslo"),
        ("12", {"type": "string"}, "12"),
        (" 12 ", {"type": "integer"}, 12),
        ("twelve", {"type": "integer"}, "twelve"),
        ("2.50", {"type": "number"}, 2.5),
        ("3", {"type": "number"}, 3),
        ("TRUE", {"type": "boolean"}, True),
        ("yes", {"type": "boolean"}, "yes"),
        ("null", {"type": "null"}, None),
        ("[1]", {"type": "array"}, [1]),
        ("{bad", {"type": "object"}, "{bad"),
        ("5", None, 5),
        ("hi", None, "hi"),
        ("7", {"type": ["integer", "null"]}, 7),
        ("\n\t Oslo \r\n", {"enum": ["Paris", "Oslo"]}, "Oslo"),
        (" 2 ", {"enum": [1, 2]}, 2),
        ("Rome", {"enum": ["Paris", "Oslo"]}, "Rome"),
        (" x ", {"const": "x"}, "x"),
        ("a\nb", {"type": "string"}, "a\nb"),
    ],
)
def test_typed_value(text: str, schema, want) -> None:
    assert json.loads(typed_value(text, schema)) == want


def test_a_constrained_call_in_the_xml_form_through_the_server(tiny_model_dir) -> None:
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Oslo"]},
                    "metric": {"type": "boolean"},
                    "days": {"type": "integer"},
                },
                "required": ["city", "metric", "days"],
                "additionalProperties": False,
            },
        },
    }
    with live_server(tiny_model_dir, tool_call_format="xml") as srv:
        assert srv.state.tool_call_xml
        msg = (
            srv.client()
            .chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": "Weather?"}],
                tools=[weather],
                tool_choice="required",
                max_tokens=200,
                temperature=0,
            )
            .choices[0]
            .message
        )
        (call,) = msg.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and set(args) == {"city", "metric", "days"}
        assert (
            args["city"] in ("Paris", "Oslo")
            and isinstance(args["metric"], bool)
            and isinstance(args["days"], int)
        )
