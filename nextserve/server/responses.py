"""The OpenAI Responses dialect: its request models, its conversation (input items, `instructions`, and the
stored responses `previous_response_id` chains) as the chat route's request, and the store of responses.
`/v1/responses` then renders the chat template, checks limits, samples and parses tool calls exactly as
`/v1/chat/completions` does: one conversation gives the same prompt tokens through chat, Messages and
Responses, and prefix reuse works across them.

# NOTE: choices where the API is wider than this server:
# - `function` tools, and `namespace` tools flattened into their function tools (the model sees each
#   function by its own name; a call comes back as a function_call item with that name and its
#   `namespace`; two functions of one name are a 400). Built-in tools (web_search, file_search, ...,
#   which Codex sends by default) are left out of the prompt with one warning line, so the model never
#   calls them; a tool_choice that names one is a 400;
# - `item_reference` items, `background`, `conversation` and `prompt` templates are refused (400);
# - unknown top-level fields (Codex's `client_metadata`) are accepted and ignored with one warning line;
# - reasoning items of earlier turns go to the template as the next assistant turn's `reasoning_content`
#   (the template decides whether to render them); `reasoning.effort` "none" turns the template's
#   `enable_thinking` off; the answer's thinking comes back as a `reasoning` item with `reasoning_text`
#   content (no summaries: `summary` is empty), as vLLM returns it;
# - `store` (default true) keeps the response and its conversation in memory, the newest
#   STORE_CAPACITY of them, each visible only to the tenant (API key) that made it; `previous_response_id`
#   continues one of them (its `instructions` are not carried over, as in the API);
# - `prompt_cache_key`, `include`, `truncation` ("disabled"), `service_tier`, `user`, `safety_identifier`
#   and `metadata` are accepted; every prompt is cached on the prefill grid anyway.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter

from . import protocol as P

STORE_CAPACITY = 1024  # stored responses kept (oldest dropped first)
# NOTE: input items are what clients send back of earlier responses, with fields this server may not know
_ITEM = ConfigDict(extra="ignore", strict=True)


class InputText(BaseModel):
    model_config = _ITEM
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: str


class InputMedia(BaseModel):
    model_config = _ITEM
    type: Literal["input_image", "input_file", "input_audio", "refusal"]


Content = Annotated[InputText | InputMedia, Field(discriminator="type")]


class MessageItem(BaseModel):
    model_config = _ITEM
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Content]


class FunctionCallItem(BaseModel):
    model_config = _ITEM
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = _ITEM
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[Content]


class ReasoningItem(BaseModel):
    model_config = _ITEM
    type: Literal["reasoning"]
    summary: list[InputText] = Field(default_factory=list)
    content: list[InputText] | None = None


RefusedKind = Literal[
    "item_reference", "file_search_call", "web_search_call", "computer_call", "image_generation_call"
]


class RefusedItem(BaseModel):
    model_config = _ITEM
    type: RefusedKind


def _item_kind(v: Any) -> str:
    """An input item's tag: its `type` ("message" when it has none, as the API allows), "refused" for the
    types this server refuses by name."""
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")
    return "refused" if kind in get_args(RefusedKind) else kind


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[RefusedItem, Tag("refused")],
    Discriminator(_item_kind),
]


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class NamespaceTool(BaseModel):
    """Function tools grouped under a name (module NOTE: flattened)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: str | None = None
    tools: list[FunctionTool]


class BuiltinTool(BaseModel):
    """A tool OpenAI's servers run (web_search, file_search, code_interpreter, ...): left out (NOTE)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


def _tool_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return kind if kind in ("function", "namespace") else "builtin"


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[BuiltinTool, Tag("builtin")],
    Discriminator(_tool_kind),
]


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    name: str


class NamedBuiltin(BaseModel):
    """A tool_choice naming a built-in tool ({"type": "web_search"}) or allowed tools: refused."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


def _choice_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return "function" if kind == "function" else "other"


ToolChoice = Annotated[
    Annotated[NamedFunction, Tag("function")] | Annotated[NamedBuiltin, Tag("other")],
    Discriminator(_choice_kind),
]


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class InputTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # unknown fields: module NOTE
    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    conversation: Any = None


class ResponsesRequest(InputTokensRequest):
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: P.Finite | None = Field(default=None, ge=0.0, le=2.0)
    top_p: P.Finite | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=0)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool = True
    background: bool = False
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    prompt: Any = None
    service_tier: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    # documented, accepted and ignored: they tune OpenAI's service, not the answer
    context_management: Any = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    moderation: Any = None
    background_options: Any = None
    access_programs: Any = None
    image: Any = None
    # nextserve's extensions, as on the chat route (vLLM's names)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    seed: int | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    ignore_eos: bool = False


@dataclass
class Stored:
    """One stored response: its JSON body, the chat messages of the conversation it answered (without
    its instructions) and its own answer as one assistant message, and the tenant that made it."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]]
    answer: dict[str, Any]
    tenant: str


@dataclass
class ResponseStore:
    capacity: int = STORE_CAPACITY
    items: OrderedDict[str, Stored] = field(default_factory=OrderedDict)

    def put(self, rid: str, stored: Stored) -> None:
        self.items[rid] = stored
        self.items.move_to_end(rid)
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def get(self, rid: str, tenant: str) -> Stored | None:
        """The stored response `rid` of `tenant` (another tenant's is as absent as an unknown id)."""
        got = self.items.get(rid)
        return got if got is not None and got.tenant == tenant else None

    def delete(self, rid: str, tenant: str) -> bool:
        if self.get(rid, tenant) is None:
            return False
        del self.items[rid]
        return True


def _text(content: str | list, where: str) -> str:
    if isinstance(content, str):
        return content
    if any(isinstance(c, InputMedia) for c in content):
        raise ValueError(f"{where}: images, files and audio are not supported: this model reads text only")
    return "".join(c.text for c in content)


def input_messages(req: InputTokensRequest) -> list[dict[str, Any]]:
    """The request's input items as chat-completions messages: consecutive reasoning, assistant text and
    function_call items make one assistant turn (its `reasoning_content`, content and `tool_calls`);
    function_call_output items become `tool` messages; developer messages are system messages."""
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else (req.input or [])
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn being gathered

    def assistant() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
        return turn

    for i, item in enumerate(items):
        where = f"input.{i}"
        if isinstance(item, RefusedItem):
            raise ValueError(f"{where}: items of type {item.type!r} are not supported")
        if isinstance(item, ReasoningItem):
            parts = item.content if item.content else item.summary
            text = "".join(p.text for p in parts)
            t = assistant()
            t["reasoning_content"] = t.get("reasoning_content", "") + text
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            assistant().setdefault("tool_calls", []).append(call)
        elif isinstance(item, MessageItem) and item.role == "assistant":
            t = assistant()
            if t.get("tool_calls"):  # text after a call starts the next turn
                turn = None
                t = assistant()
            t["content"] += _text(item.content, where)
        else:
            turn = None
            if isinstance(item, FunctionCallOutputItem):
                out.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, where)}
                )
            else:
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": _text(item.content, f"{where}.content")})
    return out


def builtin_tools(req: InputTokensRequest) -> list[str]:
    """The built-in tools the request names (left out of the prompt: module NOTE)."""
    return [t.type for t in req.tools or [] if isinstance(t, BuiltinTool)]


def namespaces(req: InputTokensRequest) -> dict[str, str]:
    """The namespace of each function that came in a namespace tool, by the function's name."""
    return {f.name: t.name for t in req.tools or [] if isinstance(t, NamespaceTool) for f in t.tools}


def _tools(tools: list | None) -> list[dict[str, Any]] | None:
    """The function tools, namespaces flattened, as the chat route's tools (None: none)."""
    out: list[dict[str, Any]] = []
    where: dict[str, str] = {}
    for i, t in enumerate(tools or []):
        group = [(f"tools.{i}", t)] if isinstance(t, FunctionTool) else []
        if isinstance(t, NamespaceTool):
            group = [(f"tools.{i}.tools.{j}", f) for j, f in enumerate(t.tools)]
        for at, f in group:
            if f.name in where:
                raise ValueError(f"{at}.name: {f.name!r} is also the function at {where[f.name]}")
            where[f.name] = at
            fn = {
                "name": f.name,
                "description": f.description,
                "parameters": f.parameters or {"type": "object"},
            }
            out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out or None


def chat_request(
    req: InputTokensRequest, previous: Stored | None, context: dict[str, Any]
) -> tuple[P.ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat-completions request the Responses request is (validated as the chat route validates), and
    the conversation's messages without the instructions (what a stored response keeps)."""
    for name in ("conversation",) + (("prompt",) if isinstance(req, ResponsesRequest) else ()):
        if getattr(req, name) is not None:
            raise ValueError(f"{name}: not supported: send the conversation as input items")
    if isinstance(req, ResponsesRequest) and req.background:
        raise ValueError("background: background responses are not supported")
    conversation = ([*previous.conversation, previous.answer] if previous else []) + input_messages(req)
    if not conversation:
        raise ValueError("input: the request has no input (and no previous_response_id)")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"model": req.model, "messages": system + conversation}
    if (tools := _tools(req.tools)) is not None:
        body["tools"] = tools
    if isinstance(req.tool_choice, NamedBuiltin):
        kind = req.tool_choice.type
        what = "a set of allowed tools" if kind == "allowed_tools" else f"the built-in tool {kind!r}"
        raise ValueError(f"tool_choice: {what} is not supported: name a function tool, or auto/required/none")
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.reasoning is not None and req.reasoning.effort == "none":
        body["chat_template_kwargs"] = {"enable_thinking": False}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        spec = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": {k: v for k, v in spec.items()
                                                                          if v is not None}}  # fmt: skip
    if isinstance(req, ResponsesRequest):
        extra = {"max_tokens": req.max_output_tokens, "stream": req.stream or None,
                 "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
                 "cache_salt": req.cache_salt, "guided_regex": req.guided_regex,
                 "guided_grammar": req.guided_grammar, "ignore_eos": req.ignore_eos or None}  # fmt: skip
        body |= {k: v for k, v in extra.items() if v is not None}
    return _CHAT.validate_python(body, context=context), conversation


_CHAT = TypeAdapter(P.ChatCompletionRequest)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_body(
    rid: str, model: str, req: ResponsesRequest, status: str, output: list[dict[str, Any]],
    usage: dict[str, Any] | None, created: int | None = None, incomplete: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A Response object (the request's settings echoed, as the API does)."""
    fmt = (
        req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    )
    return {
        "id": rid, "object": "response", "created_at": created or int(time.time()), "status": status,
        "model": model, "output": output, "usage": usage, "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": req.instructions, "previous_response_id": req.previous_response_id,
        "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "tool_choice": (req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction)
                        else req.tool_choice or "auto"),
        "parallel_tool_calls": req.parallel_tool_calls is not False, "store": req.store,
        "metadata": req.metadata or {}, "text": {"format": fmt or {"type": "text"}},
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "truncation": "disabled", "background": False, "user": req.user,
    }  # fmt: skip


def answer_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the assistant chat message a later turn renders."""
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "reasoning":
            turn["reasoning_content"] = "".join(c["text"] for c in item.get("content") or [])
        elif item["type"] == "message":
            turn["content"] += "".join(c["text"] for c in item["content"])
        elif item["type"] == "function_call":
            turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})  # fmt: skip
    return turn


def dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, ensure_ascii=False)
