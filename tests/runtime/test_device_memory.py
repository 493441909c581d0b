"""--gpu-memory-gib: the free memory an engine plans with is the cap less what its allocator holds (never more
than the device has free), the allocator is capped at it, and its wrong values are ConfigErrors. (The GPU run
that reproduces a 24 GB card on an H100 is the host-experts issue's benchmark.)"""

from __future__ import annotations

import pytest
import torch

from nextserve.config import ConfigError
from nextserve.engine_config import EngineConfig
from nextserve.runtime import device_memory

GiB = 2**30


def test_free_bytes_follow_the_cap(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (70 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 3 * GiB)
    dev = torch.device("cuda", 0)
    assert device_memory.free_bytes(dev) == 70 * GiB
    assert device_memory.free_bytes(dev, 24) == 21 * GiB  # 24 GiB less this process's 3
    assert device_memory.free_bytes(dev, 79.5) == 70 * GiB  # never more than the device has
    assert device_memory.free_bytes(dev, 2) == 0


def test_the_allocator_is_capped(monkeypatch) -> None:
    class Props:
        total_memory = 80 * GiB

    got = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: got.append((f, d)))
    dev = torch.device("cuda", 0)
    device_memory.cap_device_memory(dev, 24)
    assert got == [(24 / 80, dev)]
    device_memory.cap_device_memory(torch.device("cpu"), 24)  # nothing on the CPU
    device_memory.cap_device_memory(dev, None)
    assert len(got) == 1
    with pytest.raises(ConfigError, match="more than"):
        device_memory.cap_device_memory(dev, 81)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"device": "cuda", "gpu_memory_gib": 0}, "positive"),
        ({"device": "cuda", "gpu_memory_gib": -4}, "positive"),
        ({"device": "cuda", "gpu_memory_gib": "24"}, "positive"),
        ({"device": "cuda", "gpu_memory_gib": True}, "positive"),
        ({"device": "cpu", "gpu_memory_gib": 24}, "cpu_kv_budget_mib"),
        ({"device": "cuda", "gpu_memory_gib": 24, "pipeline_stages": 2}, "pipeline stages"),
    ],
)
def test_bad_gpu_memory_gib(kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kw)


def test_the_memory_plan_reads_the_capped_free_memory(monkeypatch, tmp_path) -> None:
    """A model that fits the device but not a 1 GiB cap is refused by the plan, naming the cap's figure."""
    from nextserve.engine import memory_plan
    from nextserve.model.make_model import make_model

    d = make_model("tiny", tmp_path / "m", seed=0)
    monkeypatch.setattr(memory_plan, "free_bytes", lambda dev, gib: int(gib * GiB) if gib else 80 * GiB)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev: (9, 0))
    config = EngineConfig(
        model=str(d), device="cuda", gpu_memory_gib=0.001, memory_headroom_mib=0, max_concurrency=16
    )
    from nextserve.config import ModelConfig

    cfg = ModelConfig.from_dir(d)
    with pytest.raises(ConfigError, match="does not fit"):
        memory_plan.plan_memory(config, cfg, torch.device("cuda", 0), torch.bfloat16, 0, False)
