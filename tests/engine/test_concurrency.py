"""--max-concurrency auto (engine/concurrency.py): on a GPU the sequences whose state slots fit half the
memory left after the weights, headroom and one sequence of KV, between 1 and AUTO_CAP, fewer with the keep
slots of speculation; 16 on the CPU and with pipeline stages; a number as given; bad values refused."""

from __future__ import annotations

import pytest
import torch

from nextserve import LLM
from nextserve.cli import build_parser, engine_config_from_args
from nextserve.config import ConfigError, ModelConfig
from nextserve.engine import memory_plan
from nextserve.engine.concurrency import AUTO_CAP, AUTO_OTHER, STATE_SHARE, resolve_max_concurrency
from nextserve.engine.memory_plan import SEQUENCE_TOKENS, plan_memory
from nextserve.engine_config import DEFAULT_MODEL, EngineConfig
from nextserve.model.make_model import make_model

GiB = 2**30
CUDA = torch.device("cuda", 0)


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """The tiny preset's directory and config, planned as if on a GPU (nothing is allocated)."""
    d = make_model("tiny", tmp_path / "m", seed=0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev: (9, 0))
    return d, ModelConfig.from_dir(d)


def _auto(monkeypatch, tiny, free_gib: float, **flags) -> int:
    d, cfg = tiny
    monkeypatch.setattr(memory_plan, "free_bytes", lambda dev, gib: int(free_gib * GiB))
    config = EngineConfig(model=str(d), device="cuda", memory_headroom_mib=0, **flags)
    steps = config.speculative_tokens if config.speculative_method != "off" else 0
    return resolve_max_concurrency(config, cfg, CUDA, torch.bfloat16, steps).max_concurrency


def test_a_roomy_gpu_gets_the_cap(monkeypatch, tiny) -> None:
    assert _auto(monkeypatch, tiny, 40) == AUTO_CAP


def test_a_tight_gpu_gets_what_half_its_spare_memory_holds(monkeypatch, tiny) -> None:
    d, cfg = tiny
    monkeypatch.setattr(memory_plan, "free_bytes", lambda dev, gib: 100 * GiB)
    one = EngineConfig(model=str(d), device="cuda", memory_headroom_mib=0, max_concurrency=1)
    plan = plan_memory(one, cfg, CUDA, torch.bfloat16, 0, False)
    kv = min(cfg.max_position_embeddings, SEQUENCE_TOKENS) * plan.kv_per_token
    fixed = plan.device_bytes() + plan.headroom + plan.slot_bytes + kv
    for sequences in (1, 5, 20):
        free = fixed + sequences * plan.slot_bytes / STATE_SHARE + 1
        assert _auto(monkeypatch, tiny, free / GiB) == sequences
        n = _auto(monkeypatch, tiny, free / GiB, speculative_method="ngram", speculative_tokens=4)
        assert n == max(1, sequences // 5)  # (each sequence holds 4 keep slots more)
    # what auto picks fits the plan, with room for one sequence's KV
    n = _auto(monkeypatch, tiny, (fixed + 7 * plan.slot_bytes / STATE_SHARE) / GiB)
    fits = EngineConfig(model=str(d), device="cuda", memory_headroom_mib=0, max_concurrency=n)
    plan_memory(fits, cfg, CUDA, torch.bfloat16, 0, False)


def test_a_gpu_too_small_for_one_sequence_is_told_so(monkeypatch, tiny) -> None:
    with pytest.raises(ConfigError, match="does not fit"):
        _auto(monkeypatch, tiny, 1e-4)


def test_cpu_and_pipeline_stages_get_sixteen_and_numbers_stay(tiny) -> None:
    d, cfg = tiny
    for config, device in (
        (EngineConfig(model=str(d), device="cpu"), torch.device("cpu")),
        (EngineConfig(model=str(d), pipeline_stages=2), CUDA),
    ):
        assert resolve_max_concurrency(config, cfg, device, torch.float32, 0).max_concurrency == AUTO_OTHER
    given = EngineConfig(model=str(d), max_concurrency=5)
    assert resolve_max_concurrency(given, cfg, CUDA, torch.float32, 0) is given
    llm = LLM(DEFAULT_MODEL, device="cpu", dtype="float32", kv_capacity=1024, page_size=16)
    assert llm.engine.config.max_concurrency == AUTO_OTHER and llm.stats()["state_slots_total"] == AUTO_OTHER


@pytest.mark.parametrize("bad", [0, -1, "many", True, 2.5, None])
def test_max_concurrency_values(bad) -> None:
    with pytest.raises(ConfigError, match="max_concurrency must be a positive integer or 'auto'"):
        EngineConfig(max_concurrency=bad)


def test_the_flag_takes_auto_and_numbers() -> None:
    for given, want in (("auto", "auto"), ("8", 8)):
        args = build_parser().parse_args(["serve", "--max-concurrency", given])
        assert engine_config_from_args(args).max_concurrency == want
    assert EngineConfig().max_concurrency == "auto"
    with pytest.raises(AssertionError, match="resolved by the engine"):
        _ = EngineConfig().state_slots


@pytest.mark.parametrize(
    "name", ["prefill_chunk", "page_size", "max_pending", "pipeline_stages", "decode_groups"]
)
def test_a_count_is_no_bool(name) -> None:
    """True passed for an integer flag (a bool is an int to isinstance) was taken as 1."""
    with pytest.raises(ConfigError, match=f"{name} must be a positive integer"):
        EngineConfig(**{name: True})
