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


# NOTE: what a schema's compile costs follows its objects and arrays, and also its enum values (40,000
# short strings took 26 s and 385 MB to compile on the 2-core machine, 10,000 took 1.6 s), long literals
# and $ref expansions (a reference costs what it names, each time it is used); length and count bounds
# (maxLength 524,288) cost nothing. `schema_size` counts them as nodes: one per object or array, per
# property, per enum value, per 64 characters of a literal.
_PER = 64


def schema_size(schema: Any) -> tuple[int, int]:
    """(compile-cost nodes, the deepest nesting) of a schema, counted without recursion (NOTE above)."""
    nodes, deepest, stack = 0, 0, [(schema, 1, ())]
    defs_cost: dict[str, int] = {}
    while stack:
        v, d, refs = stack.pop()
        if not isinstance(v, dict | list):
            continue
        nodes, deepest = nodes + 1, max(deepest, d)
        if isinstance(v, list):
            stack.extend((x, d + 1, refs) for x in v)
            continue
        for key, x in v.items():
            if key in ("enum", "examples") and isinstance(x, list):
                nodes += sum(1 + len(json.dumps(e)) // _PER for e in x)
            elif key in ("const", "default"):
                nodes += len(json.dumps(x)) // _PER
            elif key == "properties" and isinstance(x, dict):
                nodes += len(x)  # each property a rule of its own, beside its schema
                stack.append((x, d + 1, refs))
            elif key == "$ref" and isinstance(x, str) and x not in refs:
                if x not in defs_cost:
                    target = _resolve(schema, x)
                    defs_cost[x] = schema_size(target)[0] if target is not None and target is not v else 0
                nodes += defs_cost[x]
            else:
                stack.append((x, d + 1, refs))
    return nodes, deepest


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local reference ("#/$defs/x") names, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def schema_nodes(schema: Any) -> int:
    return schema_size(schema)[0]


# NOTE: keywords the grammar engine (xgrammar 0.2) accepts but does not enforce: an answer could break them
# (`{"not": {}}` gave a number, `allOf` of string and integer a string). A schema that would be compiled with
# one is refused, never loosened. Found by compiling each and matching an instance that breaks it.
UNENFORCED = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "contains",
)
_NAMES = ("properties", "patternProperties", "$defs", "definitions")  # their keys are names, not keywords
_DATA = ("enum", "const", "default", "examples")  # their values are data, not schemas


def unenforced_keyword(schema: Any) -> str | None:
    """The first keyword of `schema` the grammar engine would not enforce, with where it is, or None."""
    stack: list[tuple[Any, str]] = [(schema, "$")]
    while stack:
        v, at = stack.pop()
        if isinstance(v, list):
            stack.extend((x, f"{at}[{i}]") for i, x in enumerate(v))
            continue
        if not isinstance(v, dict):
            continue
        for key, x in v.items():
            where = f"{at}.{key}"
            if key in UNENFORCED:
                return f"`{key}` (at {where})"
            if key == "allOf" and isinstance(x, list) and len(x) > 1:
                return f"`allOf` with {len(x)} branches (at {where})"
            if key == "uniqueItems" and x is True:
                return f"`uniqueItems` (at {where})"
            if key in _NAMES and isinstance(x, dict):
                stack.extend((sub, f"{where}.{name}") for name, sub in x.items())
            elif key not in _DATA:
                stack.append((x, where))
    return None


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
