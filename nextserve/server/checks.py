"""The checks a request passes before the engine sees it (the ones pydantic cannot make: fields against
each other, against the model and its limits), and its SamplingParams."""

from __future__ import annotations

from ..engine.sampling import SamplingParams
from . import protocol as P
from .errors import APIError, bad
from .render import FORBIDDEN_TEMPLATE_KWARGS, check_template_kwargs
from .state import ServerState


def check_model(srv: ServerState, model: str | None) -> None:
    if model is not None and model not in (srv.name, srv.model_path):
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def check_common(srv: ServerState, req: P._SamplingFields) -> None:
    check_model(srv, req.model)
    limit = srv.engine.config.max_pending
    if (req.n or 1) > limit:
        raise bad(f"n is {req.n}; this server queues at most {limit} requests (--max-pending)", param="n")
    for key in req.logit_bias or {}:
        if int(key) >= srv.vocab_size:
            raise bad(
                f"logit_bias names token {key}, beyond the vocabulary of {srv.vocab_size}", "logit_bias"
            )
    for t in req.stop_token_ids or []:
        if t >= srv.vocab_size:
            raise bad(f"stop_token_ids must be below the vocabulary size {srv.vocab_size}", "stop_token_ids")
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options is only allowed when stream is true", param="stream_options")


def with_reasoning_default(srv: ServerState, req: P.ChatCompletionRequest) -> P.ChatCompletionRequest:
    """req with enable_thinking false where --reasoning off asks for it and the request does not say."""
    kwargs = req.chat_template_kwargs or {}
    if not srv.thinking_off or "enable_thinking" in kwargs:
        return req
    return req.model_copy(update={"chat_template_kwargs": kwargs | {"enable_thinking": False}})


def check_chat(req: P.ChatCompletionRequest) -> None:
    if req.chat_template is not None:
        raise bad(
            "chat_template is not accepted: this server renders chats with the model's own template only",
            param="chat_template",
        )
    key = check_template_kwargs(req)
    if key is not None:
        why = "a client's template" if key in FORBIDDEN_TEMPLATE_KWARGS else "a value the server sets itself"
        raise bad(f"chat_template_kwargs may not set {key!r} ({why})", param=f"chat_template_kwargs.{key}")
    if req.continue_final_message:
        if req.messages[-1].role != "assistant":
            raise bad(
                "continue_final_message needs the last message to be the assistant's",
                "continue_final_message",
            )
        if req.add_generation_prompt:
            raise bad(
                "continue_final_message continues the last message: set add_generation_prompt to false",
                param="continue_final_message",
            )
    if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
        raise bad("top_logprobs needs logprobs set to true", param="top_logprobs")
    names = [t.function.name for t in req.tools or []]
    if len(set(names)) != len(names):
        raise bad("tools must have distinct function names", param="tools")
    tc = req.tool_choice
    if tc is not None and tc not in ("none", "auto") and not req.tools:
        raise bad("tool_choice other than none/auto needs tools", param="tool_choice")
    if isinstance(tc, P.NamedToolChoice) and tc.function.name not in names:
        raise bad(
            f"tool_choice names {tc.function.name!r}, which is not among the tools", param="tool_choice"
        )


def check_completion(req: P.CompletionRequest) -> None:
    if req.best_of not in (None, 1):
        raise bad("only best_of=1 is supported", param="best_of")
    if req.suffix:
        raise bad("suffix is not supported by this model", param="suffix")
    if req.echo and req.logprobs is not None:
        raise bad("echo with logprobs is not supported (no prompt logprobs)", param="echo")


def check_length(
    srv: ServerState, n_prompt: int, max_tokens: int | None, prompt_param: str, max_param: str = "max_tokens"
) -> None:
    """The prompt fits max_context with room for max_tokens; the errors name the request's own fields
    (`prompt_param`, `max_param`: each dialect's names)."""
    if n_prompt == 0:
        raise bad("the prompt is empty", param=prompt_param)
    if n_prompt >= srv.max_context:
        raise bad(
            f"This model's maximum context length is {srv.max_context} tokens. However, your prompt has "
            f"{n_prompt} tokens, which leaves no room for a completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and n_prompt + max_tokens > srv.max_context:
        raise bad(
            f"This model's maximum context length is {srv.max_context} tokens. However, you requested "
            f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion). "
            f"Reduce the prompt or {max_param}.",
            param=max_param,
            code="context_length_exceeded",
        )


def sampling_params(
    srv: ServerState, req: P._SamplingFields, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    d = srv.defaults
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else d.get("max_tokens"),
            temperature=req.temperature if req.temperature is not None else d.get("temperature", 1.0),
            top_p=req.top_p if req.top_p is not None else d.get("top_p", 1.0),
            top_k=req.top_k if req.top_k is not None else d.get("top_k", -1),
            seed=req.seed,
            stop=req.stop,
            # (the model's own end tokens stop it unless the request ignores them)
            stop_token_ids=tuple(req.stop_token_ids or ())
            + (() if req.ignore_eos else d.get("eos_token_ids", ())),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else 1.0,
            logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
        )
    except ValueError as exc:
        raise bad(str(exc)) from None
