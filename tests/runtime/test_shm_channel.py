"""The shared-memory stage channel (`--stage-transport shm`, runtime/shm_channel.py) across real processes:
every dtype and shape arrives bit for bit and in order around a ring of 2-5 stages, also when the receivers
are slow and messages are many times a ring's size (back-pressure); a stage killed mid-hop fails its peer's
wait within seconds; no file is left in /dev/shm, also after a SIGKILL; and the flag's wrong values are
ConfigErrors. Pipelines over it: tests/runtime/test_pipeline.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nextserve.config import ConfigError
from nextserve.engine_config import EngineConfig
from nextserve.runtime.shm_channel import SHM_DIR, SLOT_BYTES, SLOTS, ShmChannel, process_alive
from nextserve.runtime.stage_channel import free_port

PEER = Path(__file__).with_name("shm_peer.py")


def _ours() -> set[str]:
    return {p for p in os.listdir(SHM_DIR) if p.startswith("nextserve-")}


def _start(world: int, mode: str = "relay") -> tuple[ShmChannel, list[subprocess.Popen]]:
    port = free_port()
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(PEER.parent), *sys.path])}
    procs = [
        subprocess.Popen([sys.executable, str(PEER), str(r), str(world), str(port), mode], env=env)
        for r in range(1, world)
    ]
    channel = ShmChannel(0, world, port)
    channel.broadcast(None)
    return channel, procs


def _messages() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = SLOTS * SLOT_BYTES * 3 // 4 + 13  # three rings' worth of bytes, not a whole number of slots
    return [
        torch.randn(4, 2560, generator=g).to(torch.bfloat16),  # a decode hop
        torch.randn(big, generator=g),
        torch.randint(-(2**62), 2**62, (3, 5, 7), generator=g),
        torch.randint(0, 255, (1,), generator=g).to(torch.uint8),
        torch.empty(0, 16),
        torch.randn(33, 17, generator=g).to(torch.float16),
        torch.tensor([True, False, True]),
        torch.tensor([float("nan"), -0.0, float("inf")]),  # bits, not values
    ]


@pytest.mark.parametrize("world,slow", [(2, False), (3, True), (5, False)])
def test_messages_go_round_the_stages_bit_for_bit_in_order(world, slow) -> None:
    before = _ours()
    channel, procs = _start(world)
    try:
        assert _ours() == before  # every ring unlinked once mapped
        msgs = _messages() * 2
        for t in msgs:  # all sent before any is taken back: the rings fill and the senders queue
            channel.send_step((list(t.shape), str(t.dtype).removeprefix("torch."), slow))
            channel.send(t, 1)
        for t in msgs:
            got = channel.recv(tuple(t.shape), t.dtype, world - 1)
            assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))
        channel.send_step(None)
        channel.flush()
        assert all(p.wait(timeout=30) == 0 for p in procs)
    finally:
        for p in procs:
            p.kill()
    assert _ours() == before


def test_a_killed_stage_fails_the_wait_within_seconds_and_leaves_no_file() -> None:
    before = _ours()
    channel, procs = _start(3, mode="hold")
    assert _ours() == before
    procs[0].kill()  # SIGKILL: no handler runs
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="stage 1 is gone"):
        channel.recv((4,), torch.float32, 1)
    assert time.monotonic() - t0 < 5
    for _ in range(SLOTS + 2):  # sends to a dead stage queue up once its ring is full, then fail on flush
        channel.send(torch.zeros(SLOT_BYTES // 4), 1)
    with pytest.raises(RuntimeError, match="stage 1 is gone"):
        channel.flush()
    procs[1].kill()
    procs[0].wait(), procs[1].wait()
    assert _ours() == before
    assert not process_alive(procs[1].pid)
    assert process_alive(os.getpid())


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"stage_transport": "tcp"}, "auto, nccl, host or shm"),
        ({"stage_transport": "nccl"}, "nccl needs CUDA"),
    ],
)
def test_bad_stage_transports_are_config_errors(kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineConfig(device="cpu", pipeline_stages=2, **kw)


def test_shm_refuses_a_dev_shm_too_small(monkeypatch) -> None:
    class Tiny:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Tiny())
    with pytest.raises(ConfigError, match="--shm-size"):
        EngineConfig(device="cpu", pipeline_stages=3, stage_transport="shm")
    assert EngineConfig(device="cpu", pipeline_stages=1, stage_transport="shm").pipeline_stages == 1


def test_shm_refuses_other_machines(monkeypatch) -> None:
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(ConfigError, match="x86-64"):
        EngineConfig(device="cpu", pipeline_stages=2, stage_transport="shm")
