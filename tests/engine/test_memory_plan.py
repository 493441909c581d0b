"""The memory plan: weights by kind and place as loaded (FP8 ones with their scales), the start-up table,
and a model that does not fit refused before any weight is read, naming the flags that would make it fit."""

from __future__ import annotations

import pytest
import torch

from nextserve import LLM
from nextserve.config import ConfigError, ModelConfig
from nextserve.engine.memory_plan import GiB, MemoryPlan, _check_fits, plan_memory, weight_kind
from nextserve.engine_config import EngineConfig
from nextserve.model.make_model import make_model
from nextserve.model.shapes import expected_shapes


def test_weight_kinds():
    assert weight_kind("layers.0.mlp.experts.gate_up_proj") == "experts"
    assert weight_kind("layers.1.ple.ple_embedding.ngram_embedding.weight") == "PLE"
    assert weight_kind("embed_tokens.weight") == weight_kind("lm_head.weight") == "embeddings"
    assert weight_kind("mtp.layer.mlp.experts.down_proj") == "MTP"
    assert weight_kind("layers.3.self_attn.q_proj.weight") == "dense"


def test_the_plan_of_an_fp8_checkpoint(tmp_path, caplog):
    d = make_model("tiny", tmp_path / "f8", quantization="fp8")
    cfg = ModelConfig.from_dir(d)
    config = EngineConfig(model=str(d), device="cpu", dtype="float32", max_concurrency=16)
    plan = plan_memory(config, cfg, torch.device("cpu"), torch.float32, steps=0, with_mtp=False)
    assert "layers.3.self_attn.o_proj.weight" in plan.fp8 and "lm_head.weight" not in plan.fp8
    # predicted bytes: an FP8 tensor is 1 byte a value plus 4 a scale block
    shapes = expected_shapes(cfg)
    dense = sum(
        (s[0] * s[1] + 4 * -(-s[0] // 128) * -(-s[1] // 128)) if n in plan.fp8 else 4 * torch.Size(s).numel()
        for n, s in shapes.items()
        if weight_kind(n) == "dense"
    )
    assert plan.weights[("dense", "device")] == dense
    with caplog.at_level("INFO"):
        llm = LLM(str(d), device="cpu", dtype="float32", max_concurrency=2)
    table = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan"))
    assert "FP8 (block-wise E4M3) tensors" in table and "KV pool" in table and "state slots: 3 x" in table
    assert llm.engine.plan.weights[("dense", "device")] == dense  # what the loaded modules hold


def test_a_model_that_does_not_fit_is_refused_naming_the_flags():
    config = EngineConfig(dtype="bfloat16", max_concurrency=32)
    plan = MemoryPlan(
        torch.device("cuda", 0), weights={("experts", "device"): 200 * GiB, ("PLE", "device"): 95 * GiB},
        slot_bytes=110 * 2**20, slots=33, headroom=2 * GiB, kv_per_token=27456, free_at_start=139 * GiB,
    )  # fmt: skip
    shapes = {
        "layers.0.mlp.experts.gate_up_proj": (512, 1280, 2560),
        "layers.1.ple.ple_embedding.ngram_embedding.weight": (10, 160),
    }
    with pytest.raises(ConfigError) as err:
        _check_fits(
            plan, config, shapes, torch.bfloat16, {"layers.1.ple.ple_embedding.ngram_embedding.weight"}
        )
    msg = str(err.value)
    for flag in ("--quantization fp8", "--ple-table host", "--max-concurrency", "--pipeline-stages"):
        assert flag in msg
    assert "does not fit cuda:0" in msg and "memory plan" in msg
    plan.free_at_start = 400 * GiB
    _check_fits(plan, config, shapes, torch.bfloat16, set())  # at 400 GiB free it fits


def test_ple_table_flag_values():
    for good in ("auto", "device", "host"):
        EngineConfig(ple_table=good)
    with pytest.raises(ConfigError, match="ple_table"):
        EngineConfig(ple_table="disk")
    for good in ("auto", "fp8", "int4", "none"):
        EngineConfig(quantization=good)
    for bad in ("int8", "gptq", "", None, 4):
        with pytest.raises(ConfigError, match="quantization"):
            EngineConfig(quantization=bad)


def test_the_table_names_the_host_arena():
    plan = MemoryPlan(torch.device("cuda", 0), slot_bytes=2**20, slots=3, headroom=GiB, host_arena=4 * GiB)
    assert "host arena (host images, preempted sequences): 4.00 GiB pinned on the host" in plan.table()
    assert "host arena" not in MemoryPlan(torch.device("cpu"), slot_bytes=2**20, slots=3).table()


def test_the_table_says_an_int8_kv_pool_and_plans_its_bytes() -> None:
    from nextserve.engine.memory_plan import state_plan

    cfg = ModelConfig.from_dir(EngineConfig().model)
    cpu = torch.device("cpu")
    wide = state_plan(EngineConfig(max_concurrency=4), cfg, cpu, torch.bfloat16, 0)
    int8 = state_plan(EngineConfig(max_concurrency=4, kv_dtype="int8"), cfg, cpu, torch.bfloat16, 0)
    assert int8.kv_dtype == "int8" and int8.kv_per_token < 0.56 * wide.kv_per_token
    int8.kv_tokens = wide.kv_tokens = 65536
    assert "KV pool in int8 with scales: 65,536 tokens" in int8.table()
    assert "KV pool: 65,536 tokens" in wide.table()


def test_experts_flag_values() -> None:
    for good in ("auto", "device", "host"):
        EngineConfig(experts=good)
    for bad in ("disk", "", None, 1):
        with pytest.raises(ConfigError, match="experts must be"):
            EngineConfig(experts=bad)
    with pytest.raises(ConfigError, match="with pipeline stages say experts host"):
        EngineConfig(experts="auto", pipeline_stages=2)
    staged = EngineConfig(experts="host", pipeline_stages=2, expert_cache_gib=1.5)
    assert staged.stage_expert_cache_gib() == 1.5
    assert EngineConfig(experts="host", pipeline_stages=2).stage_expert_cache_gib() == 0.0  # (auto: none)


def test_stage_needs_count_host_experts_off_the_gpu_and_the_cache_on_it() -> None:
    from nextserve.engine_config import DEFAULT_MODEL
    from nextserve.runtime.pipeline import StageNeeds

    cfg = ModelConfig.from_dir(DEFAULT_MODEL)
    device = StageNeeds(cfg, torch.float32, 4, 0).bytes_and_kv_per_token(range(0, 4))
    host = StageNeeds(cfg, torch.float32, 4, 0, experts_host=True).bytes_and_kv_per_token(range(0, 4))
    experts = 4 * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4  # 4 layers, float32
    assert device[0] - host[0] == experts and device[1] == host[1]
    cached = StageNeeds(cfg, torch.float32, 4, 0, experts_host=True, expert_cache_gib=0.5)
    assert cached.bytes_and_kv_per_token(range(0, 4))[0] == host[0] + GiB // 2


def _cuda_plan(monkeypatch, tmp_path, free_gib: float, **flags):
    """plan_memory of the tiny preset as if on a GPU with `free_gib` free (nothing is allocated)."""
    from nextserve.engine import memory_plan

    d = make_model(
        "tiny", tmp_path / "m", seed=0, quantization=flags.pop("quantization", None), group_size=16
    )
    monkeypatch.setattr(memory_plan, "free_bytes", lambda dev, gib: int(free_gib * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev: (9, 0))
    config = EngineConfig(model=str(d), device="cuda", memory_headroom_mib=0, max_concurrency=2, **flags)
    cfg = ModelConfig.from_dir(d)
    return plan_memory(config, cfg, torch.device("cuda", 0), torch.bfloat16, 0, False)


def test_experts_host_places_the_routed_experts_in_host_memory(monkeypatch, tmp_path) -> None:
    plan = _cuda_plan(monkeypatch, tmp_path, 10, experts="host", quantization="int4")
    experts = {n for n in expected_shapes(ModelConfig.from_dir(tmp_path / "m")) if ".mlp.experts." in n}
    assert experts and experts <= plan.host
    assert ("experts", "device") not in plan.weights and plan.weights[("experts", "host")] > 0
    assert any(n in plan.int4 for n in experts)  # int4 experts: words and scales on the host
    device = _cuda_plan(monkeypatch, tmp_path / "2", 10, experts="device")
    assert not any(".mlp.experts." in n for n in device.host)


def test_experts_auto_moves_them_only_when_they_do_not_fit(monkeypatch, tmp_path) -> None:
    roomy = _cuda_plan(monkeypatch, tmp_path, 10, experts="auto")
    assert not any(".mlp.experts." in n for n in roomy.host)
    from nextserve.engine.memory_plan import _need

    config = EngineConfig(device="cuda", memory_headroom_mib=0, max_concurrency=2)
    experts = roomy.weights[("experts", "device")]
    tight = (_need(roomy, roomy.weights, config) - experts / 2) / GiB  # fits only without the experts
    moved = _cuda_plan(monkeypatch, tmp_path / "2", tight, experts="auto", ple_table="device")
    assert any(".mlp.experts." in n for n in moved.host), moved.table()


def test_a_too_big_model_is_told_about_experts_host() -> None:
    config = EngineConfig(dtype="bfloat16", max_concurrency=4)
    plan = MemoryPlan(
        torch.device("cuda", 0), weights={("experts", "device"): 60 * GiB, ("dense", "device"): 4 * GiB},
        slot_bytes=2**20, slots=5, headroom=2 * GiB, kv_per_token=27456, free_at_start=22 * GiB,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="--experts host \\(60.0 GiB of routed experts"):
        _check_fits(
            plan, config, {"layers.0.mlp.experts.gate_up_proj": (512, 1280, 2560)}, torch.bfloat16, set()
        )
