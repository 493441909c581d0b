"""JSON schemas a request brings (`response_format`, structured outputs, tool parameters): parsing, their
size (what a grammar's size follows), and a check against the server's limits and the JSON Schema
metaschema."""

from __future__ import annotations

import json
from typing import Any

from .limits import DEFAULT_LIMITS, ServerLimits


def load_schema(v: dict[str, Any] | str) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except RecursionError:
            raise ValueError("the JSON schema nests too deeply") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
    return v


def schema_size(schema: Any) -> tuple[int, int]:
    """(objects and arrays, their deepest nesting) of a schema (what its grammar's size follows), counted
    without recursion."""
    nodes, deepest, stack = 0, 0, [(schema, 1)]
    while stack:
        v, d = stack.pop()
        if not isinstance(v, dict | list):
            continue
        nodes, deepest = nodes + 1, max(deepest, d)
        stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return nodes, deepest


def schema_nodes(schema: Any) -> int:
    return schema_size(schema)[0]


def check_json_schema(schema: Any, limits: ServerLimits = DEFAULT_LIMITS) -> None:
    """Raises ValueError when `schema` is not a JSON Schema document within the server's limits."""
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object")
    nodes, depth = schema_size(schema)
    if depth > limits.max_schema_depth:
        raise ValueError(
            f"the JSON schema nests deeper than {limits.max_schema_depth} levels (--max-schema-depth)"
        )
    if nodes > limits.max_schema_nodes:
        raise ValueError(
            f"the JSON schema holds {nodes} objects and arrays; at most {limits.max_schema_nodes} "
            "(--max-schema-nodes)"
        )
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - jsonschema ships with the server extra
        return
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(
            schema
        )
    except jsonschema.SchemaError as exc:
        raise ValueError(f"not a valid JSON schema: {exc.message}") from None
