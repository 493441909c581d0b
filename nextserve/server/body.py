"""A request body read into its pydantic model off the event loop: JSON, then the text rules (no lone
UTF-16 surrogates, no nesting deeper than MAX_BODY_DEPTH), then validation; every failure a 400 in OpenAI's
error shape naming the field."""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from .errors import APIError, bad, validation_error
from .limits import MAX_BODY_DEPTH, ServerLimits

_SURROGATE = re.compile("[\ud800-\udfff]")
# NOTE: a body is UTF-8 (RFC 8259), decoded strictly: raw surrogate bytes (\xed\xa0\x80) or a UTF-16 body
# are a 400 there; then JSON text carries a surrogate only as a \uD800-\uDFFF escape, so a body without
# such an escape needs no string scanned.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_SCALARS = {int, float, bool, type(None)}
Model = TypeVar("Model", bound=BaseModel)


class BodyTooLarge(Exception):
    """A chunked request body passed --max-request-mib (the app's middleware counts it)."""


def parse_body(raw: bytes, model: type[Model], limits: ServerLimits, max_prompt: int | None = None) -> Model:
    """The request of body `raw`; raises APIError (400) when it is not one. `max_prompt`: token-id prompts
    longer than this are refused before their items are validated (they could never run)."""
    if not raw.strip():
        raise bad("the request body is missing")
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")  # (a BOM is allowed to be ignored)
    except UnicodeDecodeError as exc:
        raise bad(f"the request body is not valid UTF-8 (byte {exc.start}: {exc.reason})") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise bad(f"the request body nests deeper than {MAX_BODY_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise bad(f"the request body is not valid JSON: {exc}") from None
    check_text(data, _SURROGATE_ESCAPE.search(raw) is not None)
    try:
        return model.model_validate(data, context={"limits": limits, "max_prompt": max_prompt})
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def check_text(data: Any, surrogates: bool = True) -> None:
    """Raises a 400 naming the first field that holds a lone surrogate (which no tokenizer and no JSON
    encoder takes: "\\ud800" is valid JSON but not text; looked for when `surrogates`) or nests deeper
    than MAX_BODY_DEPTH (named by its top-level field). Iterative: any depth."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if surrogates and _SURROGATE.search(value):
                _surrogate(path)
            continue
        if len(path) >= MAX_BODY_DEPTH and isinstance(value, dict | list):
            raise bad(f"{path[0]}: nests deeper than {MAX_BODY_DEPTH} levels", param=path[0])
        if isinstance(value, dict):
            for key, item in value.items():
                if surrogates and _SURROGATE.search(key):
                    _surrogate((*path, "<key>"))
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            kinds = set(map(type, value))  # in C: a long list of numbers costs no Python loop
            if kinds <= _SCALARS or (kinds <= _SCALARS | {str} and not surrogates):
                continue
            stack.extend(
                (item, (*path, str(i))) for i, item in enumerate(value) if type(item) not in _SCALARS
            )


def _name(path: tuple[str, ...]) -> str | None:
    return ".".join(path) or None


def _surrogate(path: tuple[str, ...]) -> None:
    name = _name(path)
    raise APIError(
        400,
        f"{name or 'the request body'}: holds a lone UTF-16 surrogate (such as \\ud800), which is not text",
        param=name,
    )
