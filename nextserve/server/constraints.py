"""A request's output constraint: response_format, the guided_* / structured_outputs extensions, or forced
tool calls (tool_choice required or named), compiled by the grammar backend; at most one per request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from . import protocol as P
from .errors import bad
from .grammar import GrammarUnavailable
from .state import ServerState

log = logging.getLogger("nextserve.server")


async def output_constraint(
    srv: ServerState, req: P._SamplingFields, tools: list[dict] | None, tool_choice: Any
):
    """The request's grammar constraint, or None."""
    g = srv.grammar
    asks: list[tuple[str, Callable[[], Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        asks.append(("response_format", g.compile_json_object))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_ if rf.json_schema else None
        asks.append(("response_format", lambda: g.compile_json_schema(schema)))
    if req.guided_json is not None:
        asks.append(("guided_json", lambda: g.compile_json_schema(req.guided_json)))
    if req.guided_regex is not None:
        asks.append(("guided_regex", lambda: g.compile_regex(req.guided_regex)))
    if req.guided_grammar is not None:
        asks.append(("guided_grammar", lambda: g.compile_ebnf(req.guided_grammar)))
    if req.guided_choice is not None:
        asks.append(("guided_choice", lambda: g.compile_choice(req.guided_choice)))
    so = req.structured_outputs
    if so is not None:
        given = [k for k in ("json_", "regex", "grammar", "choice") if getattr(so, k) is not None]
        if len(given) != 1:
            raise bad(
                "structured_outputs needs exactly one of json, regex, grammar, choice", "structured_outputs"
            )
        k = given[0]
        fn = {"json_": g.compile_json_schema, "regex": g.compile_regex, "grammar": g.compile_ebnf}.get(
            k, g.compile_choice
        )
        value = getattr(so, k)
        asks.append(("structured_outputs", lambda: fn(value)))
    forced_tools = tools and (tool_choice == "required" or isinstance(tool_choice, P.NamedToolChoice))
    if forced_tools:
        forced = tool_choice.function.name if isinstance(tool_choice, P.NamedToolChoice) else None
        parallel = bool(getattr(req, "parallel_tool_calls", True))
        asks.append(("tool_choice", lambda: g.compile_tool_calls(tools, forced, parallel)))
    if not asks:
        return None
    if len(asks) > 1:
        raise bad(
            "give at most one output constraint; got " + ", ".join(a[0] for a in asks), param=asks[1][0]
        )
    param, compile_fn = asks[0]
    if not g.available:
        if param == "tool_choice":
            # NOTE: without xgrammar a forced tool choice is a request the model may not honour; serve
            # it unconstrained (the tools are in the prompt) rather than refuse it.
            log.warning("tool_choice=%r served without a grammar: %s", tool_choice, g.error)
            return None
        raise bad(f"structured output is unavailable on this server: {g.error}", param=param)
    try:
        compiled = await asyncio.to_thread(compile_fn)
    except GrammarUnavailable as exc:
        if param == "tool_choice":
            return None
        raise bad(str(exc), param=param) from None
    except ValueError as exc:
        raise bad(str(exc), param=param) from None
    return g.constraint(compiled)
