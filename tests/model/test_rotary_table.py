"""The rotary table FlashNext.prepare builds on CUDA (rows checked against computed cos/sin on the GPU in
tests/ops/test_qsa_tail.py): its size covers every position the engine lets a sequence reach, and the CPU
keeps computing cos and sin."""

import pytest
import torch

from nextserve.config import ConfigError, EngineConfig
from nextserve.model.flash_next import ROTARY_MARGIN, FlashNext


def test_rows_cover_max_context_and_the_speculation_past_it(oracle_config) -> None:
    model = FlashNext(oracle_config)
    assert model.rotary_rows() == oracle_config.max_position_embeddings + ROTARY_MARGIN
    long = 4 * oracle_config.max_position_embeddings  # --max-context past the model's positions
    assert model.rotary_rows(long) == long + ROTARY_MARGIN
    # a verify window or MTP chain reaches speculative_tokens + 1 past a sequence's last position
    EngineConfig(speculative_tokens=32)
    with pytest.raises(ConfigError):
        EngineConfig(speculative_tokens=33)
    assert ROTARY_MARGIN >= 32 + 1


def test_cpu_model_computes_cos_sin(oracle_config) -> None:
    model = FlashNext(oracle_config)
    model.prepare(128)
    assert model.rotary_table is None
    cos, sin, rotary = model.rope(torch.arange(5), torch.float32)
    assert cos.shape == (5, oracle_config.rotary_dim) and rotary == model.cos_sin
