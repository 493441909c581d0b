"""Chat prompts: the model's own chat template over a request's messages and tools, tokenized so that what
a client wrote stays text, and the message checkpoint of the prefix cache.

# NOTE: special-token text in anything a client sends (`<|im_end|>` typed into a message, a tool result or
# a tool description) is tokenized as the characters it is, never as the control token: otherwise a user
# could close their own turn and open a system one. Only the template's own special tokens are control
# tokens. A conversation without such text is tokenized exactly as `tokenizer.encode` would, so its ids
# (and prefix reuse) are unchanged by this rule. Added tokens that are not special (`<tool_call>`,
# `<think>`) keep their ids wherever they appear, as in transformers and vLLM.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from .protocol import ChatCompletionRequest, ChatMessage

# Template arguments a client may not set through chat_template_kwargs: the ones the server sets, and a
# template of its own (a client's Jinja would run on the server: see README "Chat templates").
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "tokenize", "add_generation_prompt", "continue_final_message", "conversation"}
)
FORBIDDEN_TEMPLATE_KWARGS = frozenset({"chat_template", "template"})
_SENTINELS = "\ue000\ue001\ue002\ue003\ue004\ue005\ue006\ue007"  # private-use characters


def message_to_template(msg: ChatMessage) -> dict[str, Any]:
    """One OpenAI message as the chat template expects it."""
    role = "system" if msg.role == "developer" else msg.role
    if isinstance(msg.content, list):
        content: str | None = "\n".join(p.text or "" for p in msg.content)
    else:
        content = msg.content
    out: dict[str, Any] = {"role": role, "content": content}
    if msg.name is not None:
        out["name"] = msg.name
    if msg.tool_calls:
        # NOTE: arguments stay the JSON text the model wrote (the template inserts a string verbatim), so a
        # resent turn renders to the very tokens the model produced and the prefix cache can match them.
        out["tool_calls"] = [
            {
                "id": tc.id,
                "type": "function",
                "function": {"name": tc.function.name, "arguments": tc.function.arguments},
            }
            for tc in msg.tool_calls
        ]
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    if msg.reasoning_content:
        out["reasoning_content"] = msg.reasoning_content
    return out


def tools_for_template(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the prompt shows the model: none when tool_choice is "none"."""
    if not req.tools or req.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def check_template_kwargs(req: ChatCompletionRequest) -> str | None:
    """The first chat_template_kwargs key a client may not set (a 400 names it), or None."""
    for key in req.chat_template_kwargs or {}:
        if key in FORBIDDEN_TEMPLATE_KWARGS or key in RESERVED_TEMPLATE_KWARGS:
            return key
    return None


# ---- rendering and tokenizing ------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _special_pattern(tokenizer: Any) -> re.Pattern | None:
    """A regex of the tokenizer's special tokens (longest first), or None when it has none."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials = sorted({t.content for t in decoder.values() if getattr(t, "special", False)}, key=len)
    if not specials:
        return None
    return re.compile("|".join(re.escape(s) for s in reversed(specials)))


class _Defang:
    """Replaces special-token text in client strings with placeholders, and puts it back."""

    def __init__(self, pattern: re.Pattern, sentinel: str) -> None:
        self.pattern, self.sentinel = pattern, sentinel
        self.found: list[str] = []

    def __call__(self, value: Any) -> Any:
        if isinstance(value, str):
            if self.pattern.search(value) is None:
                return value
            return self.pattern.sub(self._hide, value)
        if isinstance(value, dict):
            return {k: self(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self(v) for v in value]
        return value

    def _hide(self, m: re.Match) -> str:
        self.found.append(m.group(0))
        return f"{self.sentinel}{len(self.found) - 1}{self.sentinel}"

    def restore(self, text: str) -> str:
        s = re.escape(self.sentinel)
        return re.sub(f"{s}(\\d+){s}", lambda m: self.found[int(m.group(1))], text)


def _sentinel_for(*values: Any) -> str:
    """A private-use character that none of the strings in values holds."""
    text = repr(values)
    for c in _SENTINELS:
        if c not in text:
            return c
    raise ValueError("the messages hold every private-use character the server marks text with")


def _render(tokenizer: Any, req: ChatCompletionRequest, messages, tools, generation_prompt: bool) -> str:
    kwargs = dict(req.chat_template_kwargs or {})
    continue_final = bool(req.continue_final_message) and generation_prompt
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=generation_prompt and req.add_generation_prompt and not continue_final,
            continue_final_message=continue_final,
            **kwargs,
        )
    except Exception as exc:  # jinja2 errors, raise_exception() in the template
        raise ValueError(f"the chat template could not render these messages: {exc}") from exc
    if not isinstance(text, str):
        raise ValueError("the chat template did not produce text")
    return text


def _encode(tokenizer: Any, text: str, defang: _Defang | None) -> list[int]:
    """Token ids of rendered text: the template's special tokens as control tokens, and (with `defang`)
    the client's special-token text, hidden while rendering, as plain text."""
    if defang is None or not defang.found:
        return list(tokenizer.encode(text, add_special_tokens=False))
    ids: list[int] = []
    pos = 0
    for m in [*defang.pattern.finditer(text), None]:
        piece = text[pos : m.start() if m is not None else len(text)]
        if piece:
            plain = defang.restore(piece)
            ids += tokenizer.encode(plain, add_special_tokens=False, split_special_tokens=True)
        if m is None:
            break
        ids.append(tokenizer.convert_tokens_to_ids(m.group(0)))
        pos = m.end()
    return ids


def encode_chat(tokenizer: Any, req: ChatCompletionRequest) -> tuple[list[int], int | None]:
    """The prompt's token ids, and where its last message starts (a message checkpoint: a client that
    rewrites that message resumes from the turns before it, DESIGN.md section 2) or None. Raises
    ValueError when the template rejects the conversation."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template: use /v1/completions")
    messages = [message_to_template(m) for m in req.messages]
    tools = tools_for_template(req)
    pattern = _special_pattern(tokenizer)
    defang = _Defang(pattern, _sentinel_for(messages, tools)) if pattern is not None else None
    if defang is not None:
        messages, tools = defang(messages), defang(tools)
    ids = _encode(tokenizer, _render(tokenizer, req, messages, tools, True), defang)
    checkpoint = None
    if len(messages) >= 2:
        try:
            head = _encode(tokenizer, _render(tokenizer, req, messages[:-1], tools, False), defang)
        except ValueError:
            head = []
        if 0 < len(head) < len(ids) and ids[: len(head)] == head:
            checkpoint = len(head)
    return ids, checkpoint
