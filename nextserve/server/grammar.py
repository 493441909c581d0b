"""Constrained decoding with xgrammar: JSON schema, any JSON object, regex, EBNF grammar, a choice
of strings, and forced tool calls, as TokenConstraint objects the engine's sampler applies.

The compiler (and the tokenizer's vocabulary table it needs) is built on first use. Compiling runs
on a worker thread, so callers should `await asyncio.to_thread(...)` the `compile_*` methods.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from .grammar_check import dead_rule
from .grammar_probe import CompileTimeout, GrammarProbe, Source
from .prepare import GrammarTimeout

log = logging.getLogger("nextserve.grammar")

try:
    import xgrammar as xgr
except Exception as exc:  # pragma: no cover - xgrammar ships with the server extra
    xgr = None
    _IMPORT_ERROR: str | None = f"{type(exc).__name__}: {exc}"
else:
    _IMPORT_ERROR = None

# NOTE: a cap on consecutive whitespace inside JSON. Unbounded whitespace lets a weak or unlucky model
# loop on spaces forever; 16 still allows pretty-printed JSON a few levels deep.
MAX_JSON_WHITESPACE = 16
COMPILED_CACHE = 64  # compiled grammars kept by their source text


_XGR_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")


class GrammarUnavailable(RuntimeError):
    """Structured output was asked for but xgrammar cannot be used with this model."""


class XGrammarConstraint:
    """One request's grammar state: which tokens may come next (a TokenConstraint)."""

    def __init__(self, compiled: Any, vocab_size: int, stop_ids: tuple[int, ...] = ()) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size, self.stop_ids = vocab_size, stop_ids
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self.failed = False

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        if self.matcher.is_terminated():
            return None
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bits = ((self.bitmask[0].unsqueeze(1) >> self._shifts) & 1).bool().flatten()
        if bits.numel() < vocab_size:
            bits = torch.cat([bits, torch.zeros(vocab_size - bits.numel(), dtype=torch.bool)])
        bits = bits[:vocab_size]
        if not bits.any():
            # NOTE: compile-time checks refuse grammars that can reach this (grammar_check.py); should one
            # slip through, the output ends here with a stop token rather than a token the grammar forbids.
            log.warning("grammar allows no next token; ending the output")
            self.failed = True
            bits[[t for t in self.stop_ids if t < vocab_size]] = True
        return bits

    def accept(self, token_id: int) -> None:
        if self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token_id):
            # NOTE: cannot happen when the sampler applied our mask; end the request rather than let
            # it go on unconstrained.
            log.warning("grammar rejected token %d; ending the request", token_id)
            self.failed = True

    def is_terminated(self) -> bool:
        return self.failed or self.matcher.is_terminated()


class GrammarBackend:
    """Compiles grammars for one model's tokenizer."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_id: int | None,
        probe: tuple[float, float] | None = None,
    ) -> None:
        """`probe`: (memory MiB, timeout s) of the worker each new compile is tried in first
        (grammar_probe.py); None compiles in this process only."""
        self.tokenizer, self.vocab_size, self.eos_token_id = tokenizer, vocab_size, eos_token_id
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._probe_limits, self.probe = probe, None
        self.error: str | None = None
        if xgr is None:
            self.error = f"xgrammar is not installed ({_IMPORT_ERROR})"
        elif tokenizer is None:
            self.error = "the model has no tokenizer"

    @property
    def available(self) -> bool:
        return self.error is None

    def _get_compiler(self) -> Any:
        if self.error is not None:
            raise GrammarUnavailable(f"structured output is unavailable: {self.error}")
        with self._lock:
            if self._compiler is None:
                try:
                    stop = [self.eos_token_id] if self.eos_token_id is not None else None
                    info = xgr.TokenizerInfo.from_huggingface(
                        self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop
                    )
                    self._compiler = xgr.GrammarCompiler(info)
                    if self._probe_limits is not None:
                        self.probe = GrammarProbe(info.serialize_json(), *self._probe_limits)
                except Exception as exc:  # noqa: BLE001 - an unusable tokenizer disables the feature
                    self.error = f"xgrammar cannot use this tokenizer ({type(exc).__name__}: {exc})"
                    raise GrammarUnavailable(f"structured output is unavailable: {self.error}") from exc
            return self._compiler

    def warm_up(self) -> None:
        """Builds the vocabulary table now rather than on the first request (best effort).

        # NOTE: the compile worker starts with the first compile, not here (its start, about 2 s, is not
        # counted against that compile's time): a server that never constrains an answer runs no worker."""
        try:
            self._get_compiler()
        except GrammarUnavailable as exc:
            log.warning("%s", exc)

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()

    def constraint(self, compiled: Any) -> XGrammarConstraint:
        stop = (self.eos_token_id,) if self.eos_token_id is not None else ()
        return XGrammarConstraint(compiled, self.vocab_size, stop)

    # ---- compilers: each raises ValueError for a bad schema/pattern ---------------------------------
    # NOTE: the dead-rule check reads the source grammar (`xgr.Grammar.from_*`, the same language as what
    # is compiled), not the compiled one: serializing a compiled grammar writes its per-rule token tables
    # (167 MB and 10 s for Claude Code's 24 tools, against 0.2 MB and 6 ms for the source grammar).
    # Compiled grammars are kept by their source (COMPILED_CACHE entries): a session resends the same
    # tools every turn, and each request makes its own matcher of the shared compiled grammar. A source
    # not kept is compiled first in the probe's worker (bounded in time and memory), then here.
    def _compile(self, what: str, source: Source) -> Any:
        kind, text, opts = source
        key = (kind, text, tuple(sorted(opts.items())))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiler = self._get_compiler()
        if self.probe is not None:
            try:
                self.probe.check(source)
            except CompileTimeout:
                raise GrammarTimeout from None
        build, method = _BUILDERS[kind]
        try:
            compiled = getattr(compiler, method)(text, **opts)
            grammar = build(text, **opts)
        except GrammarUnavailable:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with a message
            message = _XGR_PREFIX.sub("", str(exc)).strip()
            raise ValueError(f"invalid {what}: {message}") from exc
        dead = dead_rule(grammar)
        if dead is not None:
            raise ValueError(f"the {what} admits no output: its rule {dead!r} can never be completed")
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > COMPILED_CACHE:
                self._cache.popitem(last=False)
        return compiled

    def compile_json_schema(self, schema: dict[str, Any] | str) -> Any:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        opts = {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE, "strict_mode": True}
        return self._compile("JSON schema", ("json", text, opts))

    def compile_regex(self, pattern: str) -> Any:
        return self._compile("regex", ("regex", pattern, {}))

    def compile_ebnf(self, grammar: str) -> Any:
        return self._compile("grammar", ("ebnf", grammar, {}))

    def compile_choice(self, choices: list[str]) -> Any:
        ebnf = "root ::= " + " | ".join(_ebnf_string(c) for c in choices)
        return self._compile("choice", ("ebnf", ebnf, {}))

    def compile_tool_calls(
        self, tools: list[dict[str, Any]], forced: str | None, parallel: bool, xml: bool = False
    ) -> Any:
        """One or more `<tool_call>` blocks (exactly one of `forced` when named), nothing else.

        The shape is the chat template's: `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`,
        with ARGS following the tool's parameters schema; with `xml`, Qwen3-Coder's `<tool_call>\\n
        <function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>...</function>\\n</tool_call>`, its parameters
        following the schema (xgrammar's qwen_xml style).
        """
        chosen = [t for t in tools if forced is None or t["function"]["name"] == forced]
        tags = [_tool_tag(t["function"]["name"], t["function"].get("parameters") or {"type": "object"}, xml)
                for t in chosen]  # fmt: skip
        if forced is not None or not parallel:
            fmt: dict[str, Any] = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
        else:
            fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True}
        return self._compile(
            "tools", ("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}), {})
        )


# kind -> (the source grammar's builder, the compiler's method): the same language either way
_BUILDERS = {
    "json": (lambda text, **o: xgr.Grammar.from_json_schema(text, **o), "compile_json_schema"),
    "regex": (lambda text: xgr.Grammar.from_regex(text), "compile_regex"),
    "ebnf": (lambda text: xgr.Grammar.from_ebnf(text), "compile_grammar"),
    "structural_tag": (lambda text: xgr.Grammar.from_structural_tag(text), "compile_structural_tag"),
}


def _tool_tag(name: str, schema: dict[str, Any], xml: bool) -> dict[str, Any]:
    if xml:
        content = {"type": "json_schema", "json_schema": schema, "style": "qwen_xml"}
        return {"type": "tag", "begin": f"<tool_call>\n<function={name}>\n", "content": content,
                "end": "</function>\n</tool_call>"}  # fmt: skip
    content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
    return {"type": "tag", "begin": '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": ',
            "content": content, "end": "}\n</tool_call>"}  # fmt: skip


def _ebnf_string(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)
