"""The rotary table FlashNext.prepare builds on CUDA (rows checked against computed cos/sin on the GPU in
tests/ops/test_qsa_tail.py): its size covers every position the engine lets a sequence reach, and the CPU
keeps computing cos and sin."""

import pytest
import torch

from nextserve.config import ConfigError
from nextserve.engine_config import EngineConfig
from nextserve.model.flash_next import ROTARY_MARGIN, FlashNext
from nextserve.ops.rope import cos_sin


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_table_grows_for_a_later_longer_max_context(oracle_config) -> None:
    """A model prepared for one engine, then for another with a longer max_context (benchmarks reuse one
    model): the table covers the longer one (it had stayed at the first size: an out-of-bounds gather at
    the warm-up of a second engine), its rows unchanged, and the first table stays allocated."""
    model = FlashNext(oracle_config).cuda()
    model.init_buffers("cuda")
    model.prepare(64)
    first = model.rotary_table
    assert first.shape[0] == model.rotary_rows(64)
    model.prepare(32)  # shorter: the table is kept
    assert model.rotary_table is first
    model.prepare(4096)
    assert model.rotary_table.shape[0] == model.rotary_rows(4096)
    assert torch.equal(model.rotary_table[: first.shape[0]], first)
    pos = torch.tensor([70, 4095], device="cuda")
    cos, sin, _ = model.rope(pos, first.dtype)
    computed = torch.cat(cos_sin(pos, model.inv_freq, first.dtype), dim=-1)
    assert torch.equal(torch.cat([cos, sin], dim=-1), computed)
    assert len(model._superseded_tables) == 1 and model._superseded_tables[0] is first
