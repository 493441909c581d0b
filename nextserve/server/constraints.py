"""A request's output constraint: response_format, the guided_* / structured_outputs extensions, or forced
tool calls (tool_choice required or named), compiled by the grammar backend; at most one per request.
Each compile runs on a compiler thread within the request's limits (limits.py): schema size, grammar
size, and --grammar-timeout."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from fastapi import Request

from . import json_schema as J
from . import protocol as P
from .errors import bad
from .grammar import GrammarUnavailable
from .prepare import GrammarTimeout
from .state import ServerState

log = logging.getLogger("nextserve.server")


class _Ask(NamedTuple):
    field: str  # the request field that asks for it
    compile: Callable[[], Any]
    nodes: int  # objects and arrays of its JSON schemas (--max-schema-nodes)
    size: int  # bytes of its regex, EBNF grammar or choices (--max-grammar-bytes)


def _size(kind: str, value: Any) -> int:
    if kind == "choice":
        return sum(len(c.encode()) for c in value)
    return len(value.encode()) if kind in ("regex", "grammar") else 0


def _asks(srv: ServerState, req: P._SamplingFields, tools, tool_choice) -> list[_Ask]:
    """Every constraint the request asks for."""
    g = srv.grammar
    compile_of = {
        "json": g.compile_json_schema,
        "regex": g.compile_regex,
        "grammar": g.compile_ebnf,
        "choice": g.compile_choice,
    }
    wanted: list[tuple[str, str, Any]] = []  # (field, kind, value)
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        wanted.append(("response_format", "json", {"type": "object"}))
    elif rf is not None and rf.type == "json_schema":
        wanted.append(("response_format", "json", rf.json_schema.schema_ if rf.json_schema else None))
    for kind in compile_of:
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            wanted.append((f"guided_{kind}", kind, value))
    so = req.structured_outputs
    for kind in compile_of if so is not None else ():
        value = getattr(so, "json_" if kind == "json" else kind)
        if value is not None:
            wanted.append(("structured_outputs", kind, value))
    asks = []
    for field, kind, value in wanted:
        if kind == "json":
            value = J.load_schema(value)
            _enforceable(value, field)
        nodes = J.schema_nodes(value) if kind == "json" else 0
        asks.append(_Ask(field, functools.partial(compile_of[kind], value), nodes, _size(kind, value)))
    forced_tools = tools and (tool_choice == "required" or isinstance(tool_choice, P.NamedToolChoice))
    if forced_tools:
        forced = tool_choice.function.name if isinstance(tool_choice, P.NamedToolChoice) else None
        parallel = bool(getattr(req, "parallel_tool_calls", True))
        chosen = [t for t in tools if forced is None or t["function"]["name"] == forced]
        for t in chosen:
            _enforceable(
                t["function"].get("parameters") or {}, "tools", f"the parameters of {t['function']['name']!r}"
            )
        nodes = sum(J.schema_nodes(t["function"].get("parameters") or {}) for t in chosen)
        compile_fn = functools.partial(g.compile_tool_calls, tools, forced, parallel, srv.tool_call_xml)
        asks.append(_Ask("tool_choice", compile_fn, nodes, 0))
    return asks


def _enforceable(schema: Any, field: str, what: str = "the JSON schema") -> None:
    """A 400 naming the keyword when the schema about to be compiled holds one the grammar engine would
    not enforce (json_schema.UNENFORCED): refused, never loosened."""
    if (kw := J.unenforced_keyword(schema)) is not None:
        text = f"{what} uses {kw}, which constrained decoding cannot enforce; rewrite the schema without it"
        raise bad(text, param=field)


async def output_constraint(
    srv: ServerState, request: Request, req: P._SamplingFields, tools: list[dict] | None, tool_choice: Any
) -> Any:
    """The request's compiled grammar, or None (each choice then gets its own matcher of it)."""
    asks = _asks(srv, req, tools, tool_choice)
    if not asks:
        return None
    if len(asks) > 1:
        raise bad(
            "give at most one output constraint; got " + ", ".join(a[0] for a in asks), param=asks[1][0]
        )
    param, compile_fn, nodes, size = asks[0]
    limits = srv.limits
    if nodes > limits.max_schema_nodes:
        raise bad(
            f"the JSON schemas of this request hold {nodes} objects and arrays; at most "
            f"{limits.max_schema_nodes} are compiled (--max-schema-nodes)",
            param="tools" if param == "tool_choice" else param,
        )
    if size > limits.max_grammar_bytes:
        raise bad(f"{param} is {size} bytes; at most {limits.max_grammar_bytes} (--max-grammar-bytes)", param)
    g = srv.grammar
    if not g.available:
        if param == "tool_choice":
            # NOTE: without xgrammar a forced tool choice is a request the model may not honour; serve
            # it unconstrained (the tools are in the prompt) rather than refuse it.
            log.warning("tool_choice=%r served without a grammar: %s", tool_choice, g.error)
            return None
        raise bad(f"structured output is unavailable on this server: {g.error}", param=param)
    try:
        # NOTE: the worker's try (bounded by the timeout and killed past it: grammar_probe.py) and then the
        # compile here, which the try showed to end in about as long
        return await srv.prep.compile(request, 2 * limits.grammar_timeout_s + 1, compile_fn)
    except GrammarUnavailable as exc:
        if param == "tool_choice":
            return None
        raise bad(str(exc), param=param) from None
    except GrammarTimeout:
        raise bad(
            f"compiling the {param} grammar took longer than {limits.grammar_timeout_s:g} s "
            "(--grammar-timeout); simplify it",
            param=param,
        ) from None
    except ValueError as exc:
        raise bad(str(exc), param=param) from None
