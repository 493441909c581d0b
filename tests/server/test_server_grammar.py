"""xgrammar constraints on the tiny model's tokenizer: random walks through the allowed tokens always
give text the grammar accepts."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from nextserve.engine.sampling import SamplingParams, sample_row
from nextserve.server.grammar import GrammarBackend
from nextserve.server.tool_calls import parse_tool_calls

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "c": {"enum": ["r", "g"]}, "n": {"type": "integer"}},
    "required": ["ok", "c"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "g",
            "parameters": {"type": "object", "properties": {"b": {"enum": [1, 2]}}, "required": ["b"]},
        },
    },
]


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    return GrammarBackend(tok, cfg["vocab_size"], cfg["eos_token_id"])


def _walk(backend, compiled, seed: int, limit: int = 600) -> tuple[str, bool]:
    """Samples random logits through the constraint, as the engine's sampler does."""
    c = backend.constraint(compiled)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_tokens=limit)
    ids = []
    for _ in range(limit):
        logits = torch.randn(backend.vocab_size, generator=gen) * 3
        token, _ = sample_row(logits, params, gen, c)
        c.accept(token)
        ids.append(token)
        if c.is_terminated():
            break
    eos = backend.eos_token_id
    done = c.is_terminated() and ids[-1] == eos
    return backend.tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=False), done


def test_json_schema(backend):
    compiled = backend.compile_json_schema(SCHEMA)
    for seed in range(5):
        text, done = _walk(backend, compiled, seed)
        assert done, text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_choice_and_ebnf(backend):
    text, done = _walk(backend, backend.compile_regex(r"(yes|no)-[0-9]{2}"), 0)
    assert done and re.fullmatch(r"(yes|no)-[0-9]{2}", text)
    choices = ['say "hi"', "back\\slash", "two\nlines"]
    for seed in range(4):
        text, done = _walk(backend, backend.compile_choice(choices), seed)
        assert done and text in choices
    text, done = _walk(backend, backend.compile_ebnf('root ::= "a" ("b" | "c")*  "d"'), 1)
    assert done and re.fullmatch("a[bc]*d", text)


@pytest.mark.parametrize(("forced", "parallel"), [(None, True), (None, False), ("g", True)])
def test_forced_tool_calls_parse(backend, forced, parallel):
    compiled = backend.compile_tool_calls(TOOLS, forced, parallel)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        text, done = _walk(backend, compiled, seed)
        assert done, text
        parsed = parse_tool_calls(text)
        assert parsed.content is None and parsed.calls
        if forced or not parallel:
            assert len(parsed.calls) == 1
        for c in parsed.calls:
            assert forced is None or c.name == forced
            jsonschema.validate(json.loads(c.arguments), params[c.name])


@pytest.mark.parametrize(
    "bad",
    [
        lambda b: b.compile_regex("(("),
        lambda b: b.compile_json_schema({"type": "nonsense"}),
        lambda b: b.compile_ebnf("root ::= "),
    ],
)
def test_bad_grammar_is_a_value_error(backend, bad):
    with pytest.raises(ValueError, match="invalid"):
        bad(backend)
