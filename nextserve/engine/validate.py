"""The checks of a new request that need no engine state: tokenization, token ids, length. They touch
nothing, so any thread may run them while the engine thread steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import LLMEngine


def check_prompt(engine: LLMEngine, prompt: str | list[int]) -> tuple[list[int], str | None]:
    """The prompt's token ids and text (None for a token-id prompt); ValueError when the engine would
    refuse it."""
    ids, text = engine.encode(prompt)
    V = engine.model_config.vocab_size
    if not ids:
        raise ValueError("the prompt is empty")
    if any(t < 0 or t >= V for t in ids):
        raise ValueError(f"prompt token ids must be in [0, {V})")
    if len(ids) >= engine.max_context:
        raise ValueError(f"the prompt has {len(ids)} tokens; max_context is {engine.max_context}")
    return ids, text
