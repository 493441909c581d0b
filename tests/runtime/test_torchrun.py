"""Pipeline stages as torchrun's ranks (runtime/stage_launch.py): two ranks on one machine give the one
process's tokens and exit cleanly; a world that does not match --pipeline-stages is a clear error; the
setup rank 0 sends travels as wire values only."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from nextserve.config import ModelConfig
from nextserve.engine_config import DEFAULT_MODEL
from nextserve.runtime import stage_codec
from nextserve.runtime.stage_launch import RankSetup, StageSetup, torchrun_rank

GENERATE = ["-m", "nextserve.cli", "generate", "--device", "cpu", "--prompt", "The capital of France is",
            "--max-tokens", "10", "--prefill-chunk", "4"]  # fmt: skip


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1"}  # what torchrun gives each rank: the same CPU numerics
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=240)


def _torchrun(ranks: int, *flags: str) -> list[str]:
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *GENERATE, *flags]


def test_two_torchrun_ranks_give_the_one_process_tokens() -> None:
    one = _run(GENERATE)
    assert one.returncode == 0, one.stderr
    split = _run(_torchrun(2, "--pipeline-stages", "2"))
    assert split.returncode == 0, split.stderr
    assert split.stdout == one.stdout and one.stdout.strip()
    assert "Traceback" not in split.stderr and "closed the connection" not in split.stderr


def test_a_world_that_is_not_the_stage_count_is_an_error() -> None:
    out = _run(_torchrun(2))  # --pipeline-stages 1
    assert out.returncode != 0
    assert "under torchrun each rank runs one pipeline stage" in out.stderr
    assert "give --pipeline-stages 2" in out.stderr


def test_rank_setup_travels_as_wire_values() -> None:
    cfg = ModelConfig.from_dir(DEFAULT_MODEL)
    setup = StageSetup(DEFAULT_MODEL, cfg, range(2, cfg.num_hidden_layers), torch.bfloat16, 3, 40, 16, 1, 2,
                       0, 4, "cuda:1", "nccl", True, 512, True, 4, "fp8")  # fmt: skip
    wire = stage_codec.loads(stage_codec.dumps([None, RankSetup.of(setup)]))
    got = wire[1].stage_setup(rank=1, world=2, local_rank=0)
    assert got.device == "cuda:0"  # the rank's own machine's GPU of its local rank
    assert got.cfg == cfg and got.layers == setup.layers and got.dtype == torch.bfloat16
    same = ("num_slots", "num_pages", "page_size", "threads", "transport", "pdl", "max_context", "cuda_graph",
            "window_steps", "quantization", "rank", "world")  # fmt: skip
    assert all(getattr(got, k) == getattr(setup, k) for k in same)


@pytest.mark.parametrize(
    "env,want",
    [
        ({}, None),
        ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, None),
        ({"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, (3, 4, 1)),
        ({"RANK": "1", "WORLD_SIZE": "2"}, None),  # not torchrun's
    ],
)
def test_torchrun_rank(monkeypatch, env: dict, want) -> None:
    for k in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert torchrun_rank() == want
