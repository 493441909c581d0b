"""What one app knows of its model: the engine, the tokenizer, limits, sampling defaults, metrics."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.async_engine import AsyncEngine
from .grammar import GrammarBackend
from .limits import DEFAULT_LIMITS, ServerLimits
from .metrics import ServerMetrics
from .prepare import Preparer
from .reasoning import thinks
from .responses import ResponseStore


@dataclass
class ServerState:
    engine: AsyncEngine
    name: str
    api_key: str | tuple[str, ...] | None  # one key, or several (each a tenant: tenant_salt)
    keepalive_s: float
    metrics: ServerMetrics
    grammar: GrammarBackend
    tokenizer: Any
    vocab_size: int
    eos_token_id: int | None
    max_context: int
    model_path: str
    limits: ServerLimits
    prep: Preparer
    defaults: dict[str, Any] = field(default_factory=dict)  # generation_config.json sampling defaults
    token_cache: dict[int, tuple[str, list[int]]] = field(default_factory=dict)
    byte_decoder: dict[str, int] | None = None
    thinks: bool = False  # the vocabulary has <think> and </think>: answers are split (server/reasoning.py)
    template_thinks: bool = False  # the chat template reads enable_thinking
    thinking_off: bool = False  # --reasoning off: enable_thinking false unless a request sets it
    responses: ResponseStore = field(default_factory=ResponseStore)  # stored /v1/responses answers
    tool_call_xml: bool = False  # constrained tool calls in the XML form (--tool-call-format)

    @classmethod
    def for_engine(
        cls,
        engine: AsyncEngine,
        served_model_name: str,
        api_key: str | tuple[str, ...] | None,
        keepalive_s: float,
        limits: ServerLimits = DEFAULT_LIMITS,
    ) -> ServerState:
        llm = engine.engine
        tokenizer, mc = llm.tokenizer, llm.model_config
        srv = cls(
            engine=engine,
            name=served_model_name,
            api_key=(api_key if isinstance(api_key, tuple) else (api_key,)) if api_key else None,
            keepalive_s=keepalive_s,
            metrics=ServerMetrics(engine.stats, llm.device),
            grammar=GrammarBackend(
                tokenizer,
                mc.vocab_size,
                mc.eos_token_id,
                (limits.grammar_memory_mib, limits.grammar_timeout_s),
            ),
            tokenizer=tokenizer,
            vocab_size=mc.vocab_size,
            eos_token_id=mc.eos_token_id,
            max_context=llm.max_context,
            model_path=str(engine.config.model),
            limits=limits,
            prep=Preparer(engine.num_waiting, engine.config.max_pending),
            thinks=thinks(tokenizer),
            template_thinks="enable_thinking" in (getattr(tokenizer, "chat_template", None) or ""),
            tool_call_xml="<function=" in (getattr(tokenizer, "chat_template", None) or ""),
            defaults=_generation_defaults(str(engine.config.model)),
        )
        if tokenizer is not None and _is_byte_level(tokenizer):
            srv.byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
        return srv

    # -- tokens ---------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send the prompt as token ids")
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the text could not be tokenized: {exc}") from None

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_info(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text and its bytes, as OpenAI logprobs show them."""
        hit = self.token_cache.get(token_id)
        if hit is not None:
            return hit
        raw: bytes
        if self.tokenizer is None:
            raw = f"<{token_id}>".encode()
        else:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
            if piece is None:
                raw = b""
            elif token_id in added or self.byte_decoder is None:
                raw = (piece if token_id in added else self.tokenizer.decode([token_id])).encode()
            elif all(ch in self.byte_decoder for ch in piece):
                raw = bytes(self.byte_decoder[ch] for ch in piece)
            else:
                raw = self.tokenizer.decode([token_id]).encode()
        info = (raw.decode("utf-8", errors="replace"), list(raw))
        if len(self.token_cache) < 1_000_000:
            self.token_cache[token_id] = info
        return info


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in type(decoder).__name__ + repr(decoder)[:200]


def _generation_defaults(model_dir: str) -> dict[str, Any]:
    """temperature/top_p/top_k, max_new_tokens as the max_tokens of requests that give none, and every
    eos_token_id it lists as a stop token (Qwen releases list two), from the model's generation_config.json:
    the defaults vLLM applies."""
    path = Path(model_dir) / "generation_config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    out: dict[str, Any] = {}
    if not isinstance(raw, dict):
        return out
    if isinstance(raw.get("temperature"), int | float) and raw.get("do_sample", True) is not False:
        out["temperature"] = float(raw["temperature"])
    if isinstance(raw.get("max_new_tokens"), int) and raw["max_new_tokens"] >= 1:
        out["max_tokens"] = raw["max_new_tokens"]
    if isinstance(raw.get("top_p"), int | float) and 0 < raw["top_p"] <= 1:
        out["top_p"] = float(raw["top_p"])
    if isinstance(raw.get("top_k"), int) and raw["top_k"] >= -1:
        out["top_k"] = int(raw["top_k"])
    eos = raw.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    out["eos_token_ids"] = tuple(t for t in eos if isinstance(t, int) and not isinstance(t, bool) and t >= 0)
    return out
