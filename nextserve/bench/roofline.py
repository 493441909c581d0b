"""The memory-bandwidth roofline: the bytes one decode step must move, counted from the config."""

from __future__ import annotations

import math
from typing import Any

from ..config import ModelConfig
from ..model.loader import INT4_GROUP
from ..model.shapes import expected_shapes


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts `tokens` uniformly routed tokens touch (each picks top_k)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def decode_step_bytes(
    cfg: ModelConfig,
    concurrency: int,
    context: int,
    weight_bytes: int = 2,
    kv_bytes: int = 2,
    state_bytes: int = 4,
    fp8: frozenset[str] = frozenset(),
    host: frozenset[str] = frozenset(),
    int4: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Bytes one decode step of `concurrency` sequences at `context` tokens each must move in device memory.

    Counted from the config, each byte once (perfect reuse within the step):
    - weights read: every dense tensor of `expected_shapes` in full (HC norms and mixes, GDN / QSA and
      indexer projections, router, shared expert and its gate, PLE projections, final mixer, lm_head);
      one embedding row and one PLE row per n-gram head per sequence; of the routed experts, the expected
      number of distinct experts the step's tokens pick (10 at concurrency 1; uniform routing otherwise);
    - state read and written per sequence: GDN conv window (model dtype) and recurrent state (float32,
      read and written), PLE conv history, the indexer's open-block tail; QSA K/V of the selected tokens
      (min(context, budget + c - 1)), compressed indexer keys of every visible block when they must be
      scored (more visible blocks than block_topk); the new token's K/V and raw indexer key written.
    Activations and logits are not counted (a fused kernel keeps them on chip). The runtime names in `fp8`
    are block-wise FP8 (a byte a value and a float32 scale a 128 x 128 block), those in `int4` W4A16 (half a
    byte a value and a 16-bit scale a group of INT4_GROUP); those in `host` (the n-gram
    tables in pinned host memory) cross the bus, not device memory, and are counted apart.
    """
    B, t = concurrency, context
    shapes = expected_shapes(cfg)
    dense = routed = rows = host_rows = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        elem = 1 + 4 / (128 * 128) if name in fp8 else 0.5 + 2 / INT4_GROUP if name in int4 else weight_bytes
        if name == "embed_tokens.weight":
            rows += B * shape[1] * elem
        elif name.endswith("ngram_embedding.weight"):
            ple = B * cfg.ple_num_heads * shape[1] * elem
            host_rows += ple if name in host else 0
            rows += 0 if name in host else ple
        elif name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            per_expert = n // cfg.num_experts
            touched = expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, B)
            routed += touched * per_expert * elem
        else:
            dense += n * elem
    nG, nQ, nP = len(cfg.gdn_layers), len(cfg.qsa_layers), len(cfg.ple_layers)
    c = cfg.indexer_compress_ratio
    gdn_conv = (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim * kv_bytes
    gdn_rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * state_bytes
    ple_conv = (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size * cfg.hc_hidden * kv_bytes
    tail = (c - 1) * cfg.indexer_head_dim * kv_bytes
    kv_token = 2 * cfg.num_key_value_heads * cfg.head_dim * kv_bytes
    visible_blocks = (t + 1) // c
    selected = min(t + 1, cfg.indexer_budget + c - 1) if visible_blocks > cfg.block_topk else t + 1
    scored_blocks = visible_blocks if visible_blocks > cfg.block_topk else 0
    state_read = B * (
        nG * (gdn_conv + gdn_rec)
        + nP * ple_conv
        + nQ * (tail + selected * kv_token + scored_blocks * cfg.indexer_head_dim * kv_bytes)
    )
    state_written = B * (
        nG * (gdn_conv + gdn_rec) + nP * ple_conv + nQ * (kv_token + cfg.indexer_head_dim * kv_bytes)
    )
    weights = dense + routed + rows
    return {
        "concurrency": B,
        "context": t,
        "weights_read": int(weights),
        "weights_dense": int(dense),
        "weights_routed_experts": int(routed),
        "weights_embedding_rows": int(rows),
        "host_table_rows_over_the_bus": int(host_rows),
        "expected_distinct_experts_per_layer": round(
            expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, B), 2
        ),
        "state_read": int(state_read),
        "state_written": int(state_written),
        "total": int(weights + state_read + state_written),
    }


def roofline(
    cfg: ModelConfig, concurrency: int, context: int, bandwidth: float, fp8=frozenset(), host=frozenset(),
    int4=frozenset(),
) -> dict[str, Any]:  # fmt: skip
    step = decode_step_bytes(cfg, concurrency, context, fp8=fp8, host=host, int4=int4)
    seconds = step["total"] / bandwidth
    return {"bytes_per_step": step, "step_s": seconds, "tok_per_s": round(concurrency / seconds, 1)}
