"""Pydantic models of what the OpenAI-compatible endpoints answer with (chat and text completions, the model
list): the response models app.py declares, so the OpenAPI schema documents them."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class _Answer(BaseModel):
    """The envelope both endpoints answer in; each names its object and its choices."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Any]
    usage: Usage


class ChatCompletionResponse(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nextserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
