"""--max-concurrency auto: how many sequences run at once, from what the device holds.

A sequence needs a recurrent-state slot (every GDN layer's state, QSA's open indexer block: about 110 MiB at
the released size) and its KV pages. On a GPU, one process: the sequences the state slots can take in
STATE_SHARE of the memory left after the weights, the headroom, the scratch slot and one sequence of KV at
the configured context (up to SEQUENCE_TOKENS), the rest staying for the KV pool; at most AUTO_CAP, at least
one. On the CPU and with pipeline stages (whose stages differ: each would need its own count): AUTO_OTHER.

# NOTE: AUTO_CAP is 64, not vLLM's 256: the decode kernels, CUDA graph buckets and the memory plan have been
# measured up to 64 sequences (BENCHMARKS.md, Decode: c64 at --max-concurrency 64), and past that the state
# slots of the released model take 7 GiB per 64 (its KV pool would shrink instead). A number given keeps its
# meaning; the start-up log's memory table names the count auto chose.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import ModelConfig
from ..engine_config import EngineConfig
from ..runtime.device_memory import free_bytes
from .memory_plan import SEQUENCE_TOKENS, plan_memory, state_plan

AUTO_CAP = 64
AUTO_OTHER = 16
STATE_SHARE = 0.5


def resolve_max_concurrency(
    config: EngineConfig, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, steps: int,
    model: torch.nn.Module | None = None,
) -> EngineConfig:  # fmt: skip
    """`config` with max_concurrency a number (the module docstring's rule for auto); `steps`: keep slots a
    sequence holds for verify windows; `model`: weights already on the device (not counted again)."""
    if config.max_concurrency != "auto":
        return config
    if device.type != "cuda" or config.pipeline_stages > 1:
        return dataclasses.replace(config, max_concurrency=AUTO_OTHER)
    one = dataclasses.replace(config, max_concurrency=1)
    if model is None:
        with_mtp = config.speculative_method == "mtp"
        plan = plan_memory(one, cfg, device, dtype, steps, with_mtp)  # (a ConfigError if one does not fit)
        free = plan.free_at_start - plan.device_bytes()
    else:  # (a given model's weights are in memory already: what is free excludes them)
        plan = state_plan(one, cfg, device, dtype, steps)
        free = free_bytes(device, config.gpu_memory_gib)
    context = min(config.max_context or cfg.max_position_embeddings, SEQUENCE_TOKENS)
    spare = free - plan.headroom - plan.slot_bytes - context * plan.kv_per_token
    per_sequence = plan.slot_bytes * (1 + steps)
    n = int(spare * STATE_SHARE // per_sequence) if per_sequence else AUTO_CAP
    return dataclasses.replace(config, max_concurrency=max(1, min(AUTO_CAP, n)))
