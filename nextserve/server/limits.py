"""What one request may cost the server before the engine sees it: its body, the JSON schemas and grammars
it asks to compile, and how long a compile may take (`nextserve serve` flags)."""

from __future__ import annotations

import math
from dataclasses import dataclass

# NOTE: no request body nests deeper than this (a chat request nests about 6 levels, a tool schema a few
# more): deeper ones are refused before any validator walks them recursively.
MAX_BODY_DEPTH = 64


@dataclass(frozen=True)
class ServerLimits:
    max_request_mib: float = 16.0  # request bodies larger than this are answered 413
    max_schema_depth: int = 32  # nesting of objects and arrays inside one JSON schema
    max_schema_nodes: int = 2048  # objects and arrays in the schemas one request compiles together
    max_grammar_bytes: int = 65536  # a regex, an EBNF grammar, or the choices of guided_choice
    grammar_timeout_s: float = 10.0  # a grammar compile that takes longer is a 400
    grammar_memory_mib: float = 2048.0  # the most memory a grammar compile's worker process may take

    def __post_init__(self) -> None:
        positive = ("max_request_mib", "max_schema_depth", "max_schema_nodes", "max_grammar_bytes")
        for name in (*positive, "grammar_timeout_s", "grammar_memory_mib"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if self.max_schema_depth >= MAX_BODY_DEPTH:
            raise ValueError(f"max_schema_depth must be below {MAX_BODY_DEPTH}, got {self.max_schema_depth}")

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mib * 2**20)


DEFAULT_LIMITS = ServerLimits()
