"""Pydantic models of the OpenAI-compatible API's requests, validated strictly (the answers: answers.py).

Requests are strict: a string where a number belongs, a float where an integer belongs, or an
out-of-range value is a 400, as the OpenAI API answers. Unknown top-level fields are ignored (agent
clients send vendor fields such as `metadata` or `store`), but every known field is checked.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .json_schema import check_json_schema, load_schema
from .limits import DEFAULT_LIMITS, ServerLimits

_STRICT = ConfigDict(strict=True, extra="ignore")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

Finite = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = _STRICT


# ---- shared pieces -----------------------------------------------------------------------------------


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaSpec(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self, info: ValidationInfo) -> ResponseFormat:
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema")
            check_json_schema(self.json_schema.schema_, _limits(info))
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extension: exactly one of its fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    @model_validator(mode="after")
    def _one(self, info: ValidationInfo) -> StructuredOutputs:
        given = [v for v in (self.json_, self.regex, self.grammar, self.choice) if v is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, grammar, choice")
        if self.json_ is not None:
            check_json_schema(load_schema(self.json_), _limits(info))
        if self.choice is not None and (not self.choice or any(not c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        return self


class _SamplingFields(_Strict):
    """Fields that chat and completions share."""

    model: str | None = None
    temperature: Finite | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Finite | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: Finite | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    n: int | None = Field(default=1, ge=1, le=128)  # choices, each its own engine request
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Finite | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Finite | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: Finite | None = Field(default=None, gt=0.0, le=2.0)  # vLLM's extension
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    user: str | None = None
    ignore_eos: bool = False
    # vLLM's field: prefix images are shared only between requests of one salt (within a tenant)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    return_token_ids: bool = False  # vLLM's: each choice also carries its generated token ids
    # Constrained decoding extensions (vLLM's names); at most one constraint per request.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens")
        for key in v:
            if not (key.isascii() and key.isdigit() and len(key) < 12):
                raise ValueError(
                    f'logit_bias keys are token ids written as strings, such as "42"; got {key!r}'
                )
        return v

    @field_validator("guided_json")
    @classmethod
    def _guided_json(
        cls, v: dict[str, Any] | str | None, info: ValidationInfo
    ) -> dict[str, Any] | str | None:
        if v is not None:
            check_json_schema(load_schema(v), _limits(info))
        return v

    @field_validator("guided_choice")
    @classmethod
    def _choices(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or any(not c for c in v)):
            raise ValueError("guided_choice must be a non-empty list of non-empty strings")
        return v


# ---- chat ---------------------------------------------------------------------------------------------


class ContentPart(_Strict):
    type: str
    text: str | None = None

    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(
                f"content parts of type {self.type!r} are not supported: this model reads text only"
            )
        if self.text is None:
            raise ValueError("a text content part needs a string `text`")
        return self


class FunctionCallIn(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.role != "assistant":
            if self.content is None:
                raise ValueError(f"a {self.role} message needs content")
            if self.tool_calls:
                raise ValueError("only assistant messages carry tool_calls")
        return self


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _TOOL_NAME.match(v):
            raise ValueError("a function name is 1-64 characters of letters, digits, '_', '.' or '-'")
        return v

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        if v is not None:
            check_json_schema(v, _limits(info))
        return v


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    chat_template: str | None = None  # vLLM's field, refused: the server renders with the model's template
    chat_template_kwargs: dict[str, Any] | None = None

    # NOTE: cross-field checks (tool_choice against tools, top_logprobs against logprobs) are in
    # checks.py, where the error can name its field.


# ---- completions ---------------------------------------------------------------------------------------


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_length(cls, v: Any, info: ValidationInfo) -> Any:
        # NOTE: before the items are validated: a token-id prompt longer than the context never runs, and
        # checking its millions of items first would hold the interpreter for seconds
        most = (info.context or {}).get("max_prompt")
        if (
            most is not None
            and isinstance(v, list)
            and v
            and not isinstance(v[0], str | list)
            and len(v) >= most
        ):
            raise ValueError(f"the prompt has {len(v)} tokens; this model's maximum context is {most} tokens")
        return v


# ---- helpers -------------------------------------------------------------------------------------------


MAX_LOGIT_BIAS = 1024  # tokens one request may bias


def _limits(info: ValidationInfo) -> ServerLimits:
    ctx = info.context or {}
    return ctx.get("limits", DEFAULT_LIMITS)
