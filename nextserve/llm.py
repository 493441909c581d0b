"""The offline Python API: LLM(model=DIR, **engine_flags).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from .engine.engine import LLMEngine
from .engine.outputs import RequestOutput
from .engine.sampling import SamplingParams
from .engine_config import DEFAULT_MODEL, EngineConfig


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_flags) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_flags))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt (concurrently, within the engine's limits); one output per prompt, in order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if not isinstance(params, SamplingParams) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = []
        results: dict[str, RequestOutput] = {}
        pending = list(zip(prompts, plist, strict=True))
        while pending or self.engine.has_unfinished():
            # NOTE: feed the bounded queue as it drains, so any number of prompts can be given.
            while pending and len(self.engine.scheduler.waiting) < self.engine.config.max_pending:
                prompt, p = pending.pop(0)
                ids.append(self.engine.add_request(prompt, p))
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
        return [results[i] for i in ids]

    def stats(self) -> dict[str, int]:
        return self.engine.stats()

    def close(self) -> None:
        """Stop what the engine started beside it (pipeline stage processes); idempotent."""
        self.engine.close()

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model directory has no chat template")
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
