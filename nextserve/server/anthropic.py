"""The Anthropic Messages dialect: its request models, and its conversation as the chat route's request,
so `/v1/messages` renders the chat template, checks limits, samples and parses tool calls exactly as
`/v1/chat/completions` does (one conversation gives the same prompt tokens through either, and prefix
reuse works across them).

# NOTE: choices where the dialect and the chat route differ:
# - system text: lines that start with "x-anthropic-billing-header:" (which some clients put into the
#   system prompt and change every turn) are left out of the prompt, so they do not defeat prefix reuse;
# - `system`-role messages inside `messages` (Claude Code sends one after the first user turn) go to the
#   chat template as system turns where they stand: the template renders them (ChatML: a
#   `<|im_start|>system` turn in place), and prefix reuse treats them as any other turn;
# - thinking blocks of earlier assistant turns go to the template as `reasoning_content` (the template
#   decides whether they are rendered); `thinking` "enabled", "adaptive" or "between_tools" turns the
#   template's `enable_thinking` on, "disabled" off;
# - `output_config.format` (a JSON schema) constrains the answer as the chat route's response_format does;
#   `output_config.effort`, `context_management`, `container`, `inference_geo`, `speed`, `diagnostics`,
#   `metadata`, `service_tier`, `user_profile_id`, `workspace_id` and cache_control are accepted and ignored
#   (every prompt is cached on the prefill grid anyway);
#   `mcp_servers` is refused: this server connects to none;
# - server tools (a tool `type` other than "custom": web_search_..., bash_..., text_editor_..., ...) are
#   left out of the prompt with one warning line, so the model never calls them; a tool_choice that names
#   one is a 400;
# - unknown top-level fields are accepted and ignored with one warning line (clients add fields faster
#   than a local server learns them); unknown fields inside a message, a content block or a tool are a
#   400, since they may change what the request means;
# - images and documents are refused (400): the model reads text only;
# - a `model` named "claude-..." is served by this server's model (CLIENT_MODELS): Anthropic's clients name
#   their own models, several of them (Claude Code: the main one and a small one for titles), whatever the
#   endpoint; any other name this server does not serve stays a 404, as on the other routes.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter

from . import protocol as P

BILLING_HEADER = "x-anthropic-billing-header:"
CLIENT_MODELS = "claude-"  # the prefix of model names this server answers as its own (module NOTE)
# NOTE: blocks and tools take the fields the API documents (clients send back the blocks they received,
# `caller` and `citations` included) and refuse others; settings objects ignore what they do not know.
_BLOCK = ConfigDict(extra="forbid", strict=True)
_SETTINGS = ConfigDict(extra="ignore", strict=True)


class _Cached(BaseModel):
    model_config = _BLOCK
    cache_control: dict[str, Any] | None = None  # accepted, ignored (see the NOTE above)


class TextBlock(_Cached):
    type: Literal["text"]
    text: str
    citations: list[Any] | None = None


class ToolUseBlock(_Cached):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlock(_Cached):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Annotated[TextBlock | MediaBlock, Field(discriminator="type")]] = ""
    is_error: bool = False
    toolset_name: str | None = None


class ThinkingBlock(BaseModel):
    model_config = _BLOCK
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    model_config = _BLOCK
    type: Literal["redacted_thinking"]
    data: str


class MediaBlock(BaseModel):
    """An image or a document: refused with a message that says why."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document"]


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | MediaBlock,
    Field(discriminator="type"),
]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolDef(_Cached):
    """A custom (client-run) tool."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    defer_loading: bool | None = None
    input_examples: list[Any] | None = None
    allowed_callers: list[str] | None = None
    eager_input_streaming: bool | None = None


class ServerTool(BaseModel):
    """A tool the API's servers run (web search, code execution, a text editor, ...): left out (NOTE)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    name: str | None = None


def _tool_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return "custom" if kind in (None, "custom") else "server"


Tool = Annotated[
    Annotated[ToolDef, Tag("custom")] | Annotated[ServerTool, Tag("server")], Discriminator(_tool_kind)
]


class ToolChoice(BaseModel):
    model_config = _SETTINGS
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    model_config = _SETTINGS
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=0)
    display: str | None = None


class OutputFormat(BaseModel):
    model_config = _SETTINGS
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = _SETTINGS
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted, ignored
    format: OutputFormat | None = None


class _Conversation(BaseModel):
    """What both routes read: the conversation, its tools and the settings that shape the prompt. Unknown
    top-level fields are kept in `model_extra`, and ignored with a warning (module NOTE)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: dict[str, Any] | None = None  # accepted, ignored
    mcp_servers: list[Any] | None = None  # refused when not empty
    container: Any = None  # accepted, ignored


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: P.Finite | None = Field(default=None, ge=0.0, le=1.0)
    top_p: P.Finite | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    # accepted, ignored (module NOTE)
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None
    cache_control: dict[str, Any] | None = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # nextserve's extensions, as on the chat route (vLLM's names)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    guided_regex: str | None = None
    guided_grammar: str | None = None
    ignore_eos: bool = False


class CountTokensRequest(_Conversation):
    pass


def system_text(system: str | list[TextBlock] | None) -> str | None:
    """The system prompt as one text, without the lines a client changes every turn (module NOTE)."""
    if system is None:
        return None
    text = system if isinstance(system, str) else "\n".join(b.text for b in system)
    kept = [line for line in text.split("\n") if not line.startswith(BILLING_HEADER)]
    return "\n".join(kept).strip("\n") or None


def _text_of(blocks: list) -> str:
    return "\n".join(b.text for b in blocks if isinstance(b, TextBlock))


def _media_refused(where: str) -> ValueError:
    return ValueError(f"{where}: image and document blocks are not supported: this model reads text only")


def chat_messages(req: _Conversation) -> list[dict[str, Any]]:
    """The conversation as chat-completions messages (tool results become `tool` messages, tool_use blocks
    `tool_calls` whose arguments are the input as JSON, system-role messages system turns in place)."""
    out: list[dict[str, Any]] = []
    if (system := system_text(req.system)) is not None:
        out.append({"role": "system", "content": system})
    for i, msg in enumerate(req.messages):
        blocks = [TextBlock(type="text", text=msg.content)] if isinstance(msg.content, str) else msg.content
        if any(isinstance(b, MediaBlock) for b in blocks):
            raise _media_refused(f"messages.{i}.content")
        if msg.role == "system":
            if any(not isinstance(b, TextBlock) for b in blocks):
                raise ValueError(f"messages.{i}.content: a system message holds text blocks only")
            out.append({"role": "system", "content": _text_of(blocks)})
            continue
        if msg.role == "user":
            for b in blocks:
                if isinstance(b, ToolResultBlock):
                    if not isinstance(b.content, str) and any(isinstance(c, MediaBlock) for c in b.content):
                        raise _media_refused(f"messages.{i}.content (a tool result)")
                    content = b.content if isinstance(b.content, str) else _text_of(b.content)
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
            texts = [b for b in blocks if isinstance(b, TextBlock)]
            if texts or not any(isinstance(b, ToolResultBlock) for b in blocks):
                out.append({"role": "user", "content": _text_of(texts)})
            continue
        turn: dict[str, Any] = {"role": "assistant", "content": _text_of(blocks)}
        thinking = "\n".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
        if thinking:
            turn["reasoning_content"] = thinking
        calls = [b for b in blocks if isinstance(b, ToolUseBlock)]
        if calls:
            turn["tool_calls"] = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
                for b in calls
            ]
        out.append(turn)
    return out


def server_tools(req: _Conversation) -> list[str]:
    """The server tools the request names (left out of the prompt: module NOTE)."""
    return [t.name or t.type for t in req.tools or [] if isinstance(t, ServerTool)]


def _tool_choice(choice: ToolChoice | None, left_out: list[str]) -> Any:
    if choice is None or choice.type == "auto":
        return None
    if choice.type == "any":
        return "required"
    if choice.type == "none":
        return "none"
    if not choice.name:
        raise ValueError("tool_choice.name: a tool_choice of type 'tool' names the tool")
    if choice.name in left_out:
        raise ValueError(f"tool_choice.name: {choice.name!r} is a server tool, which this server cannot run")
    return {"type": "function", "function": {"name": choice.name}}


def chat_request(req: _Conversation, context: dict[str, Any]) -> P.ChatCompletionRequest:
    """The chat-completions request the Messages request is (validated as the chat route validates)."""
    if req.mcp_servers:
        raise ValueError("mcp_servers: MCP servers are not supported: this server connects to none")
    model = None if req.model is not None and req.model.startswith(CLIENT_MODELS) else req.model
    body: dict[str, Any] = {"model": model, "messages": chat_messages(req)}
    custom = [t for t in req.tools or [] if isinstance(t, ToolDef)]
    if custom:
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }  # fmt: skip
            for t in custom
        ]
    if (choice := _tool_choice(req.tool_choice, server_tools(req))) is not None:
        body["tool_choice"] = choice
    if req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use:
        body["parallel_tool_calls"] = False
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    if req.output_config is not None and req.output_config.format is not None:
        schema = req.output_config.format.schema_
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    if isinstance(req, MessagesRequest):
        body |= {"max_tokens": req.max_tokens, "stream": req.stream}
        extra = {"temperature": req.temperature, "top_p": req.top_p, "cache_salt": req.cache_salt,
                 "guided_regex": req.guided_regex, "guided_grammar": req.guided_grammar,
                 "ignore_eos": req.ignore_eos or None}  # fmt: skip
        body |= {k: v for k, v in extra.items() if v is not None}
        if req.top_k:
            body["top_k"] = req.top_k
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
    return _CHAT.validate_python(body, context=context)


_CHAT = TypeAdapter(P.ChatCompletionRequest)

# Error types of the dialect by HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
    503: "overloaded_error", 529: "overloaded_error",
}  # fmt: skip


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
