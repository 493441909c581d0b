"""Training text every machine has: the running interpreter's standard library.

Files are read in sorted path order; a fixed set (by a hash of the relative path, so the same files
whatever the Python version) is held out for validation. From the training files we also generate
ChatML conversations: a function's docstring as the user turn and its source as the answer, and a few
tool-call turns in the chat template's `<tool_call>` format."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

from ..model.tokenizer_build import ENDOFTEXT, IM_END, IM_START

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
HOLDOUT_MOD = 40  # one file in 40 is validation


def is_heldout(rel_path: str) -> bool:
    return (
        int.from_bytes(hashlib.blake2b(rel_path.encode(), digest_size=4).digest(), "little") % HOLDOUT_MOD
        == 0
    )


def stdlib_files() -> list[tuple[str, str]]:
    """(relative path, text) of every .py file of the stdlib, sorted by path (third-party trees skipped)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel = Path(dirpath).relative_to(root)
        found += [(rel / f).as_posix() for f in filenames if f.endswith(".py")]
    out = []
    for rel in sorted(found):
        try:
            out.append((rel, (root / rel).read_text(encoding="utf-8", errors="replace")))
        except OSError:
            continue
    return out


def split_files() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    files = stdlib_files()
    return [f for f in files if not is_heldout(f[0])], [f for f in files if is_heldout(f[0])]


def chat(user: str, assistant: str, system: str | None = None) -> str:
    """One conversation exactly as the tokenizer's chat template renders it (no tools)."""
    s = f"{IM_START}system\n{system}{IM_END}\n" if system else ""
    return s + f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{assistant}{IM_END}\n"


def tools_system(tools: list[dict]) -> str:
    """The system turn the chat template writes for `tools` (without its <|im_start|>system prefix)."""
    body = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    body += "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    for t in tools:
        body += "\n" + json.dumps(t, ensure_ascii=False)
    body += "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    body += "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    body += '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    return body


@dataclass
class Function:
    name: str
    doc: str
    source: str
    args: list[str]
    defaults: dict[str, str]


def functions(text: str) -> list[Function]:
    """Top-level and method functions with a docstring, their dedented source and simple arguments."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 20 or node.end_lineno - node.lineno > 60:
            continue
        # NOTE: line slicing, not ast.get_source_segment, which re-splits the whole file per call.
        src = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno])).rstrip()
        if node.decorator_list or len(src) > 1500:
            continue
        args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
        defaults = {}
        for a, d in zip(node.args.args[::-1], node.args.defaults[::-1], strict=False):
            if isinstance(d, ast.Constant) and isinstance(d.value, (str, int, float, bool)):
                defaults[a.arg] = d.value
        out.append(Function(node.name, doc.strip(), src, args, defaults))
    return out


def _tool(fn: Function) -> dict:
    props = {a: {"type": "string"} for a in fn.args[:4]}
    return {
        "type": "function",
        "function": {
            "name": fn.name,
            "description": fn.doc.split("\n")[0][:200],
            "parameters": {"type": "object", "properties": props, "required": fn.args[:2]},
        },
    }


def chat_examples(train_files: list[tuple[str, str]], seed: int, max_tool: int = 3000) -> list[str]:
    """Docstring -> function conversations for every documented function, plus up to `max_tool`
    tool-call conversations (the user asks in the docstring's words; the answer is one tool call)."""
    rng = random.Random(seed)
    convs, tool_convs = [], []
    for _, text in train_files:
        for fn in functions(text):
            first = fn.doc.split("\n\n")[0]
            convs.append(chat(f"Write a Python function `{fn.name}`: {first}", fn.source))
            if fn.args and len(tool_convs) < max_tool * 4:
                tool_convs.append(fn)
    rng.shuffle(tool_convs)
    for i, fn in enumerate(tool_convs[:max_tool]):
        others = [tool_convs[(i + j) % len(tool_convs)] for j in (7, 13)]
        tools = [_tool(fn)] + [_tool(o) for o in others]
        rng.shuffle(tools)
        arguments = {a: str(fn.defaults.get(a, f"{a}_value")) for a in fn.args[:2]}
        call = json.dumps({"name": fn.name, "arguments": arguments}, ensure_ascii=False)
        ask = fn.doc.split("\n")[0].rstrip(".")
        user = (
            f"Please {ask[:1].lower()}{ask[1:]} ("
            + ", ".join(f"{k}={v}" for k, v in arguments.items())
            + ")."
        )
        convs.append(chat(user, f"<tool_call>\n{call}\n</tool_call>", tools_system(tools)))
    return convs


def tokenizer_texts(train_files: list[tuple[str, str]], max_chars: int) -> list[str]:
    """A spread of the training files (every file's head, in order) for the BPE trainer."""
    per = max(1000, max_chars // max(1, len(train_files)))
    return [t[:per] for _, t in train_files]


def encode_stream(tok, texts: list[str], sep: int | None) -> tuple[list[int], list[int]]:
    """Token ids of texts back to back (with `sep` after each), and each text's start offset."""
    ids, starts = [], []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        starts.append(len(ids))
        ids += enc.ids
        if sep is not None:
            ids.append(sep)
    return ids, starts


__all__ = ["ENDOFTEXT", "chat", "chat_examples", "encode_stream", "functions", "is_heldout", "split_files"]
