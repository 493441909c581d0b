"""nextserve: an inference server for Flash-Next (qwen4_exp) models."""

from .engine.outputs import RequestOutput
from .engine.sampling import SamplingParams
from .llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
