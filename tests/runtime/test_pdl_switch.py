"""The --pdl switch: a boolean flag, a no-op off sm_90+ GPUs, and each engine's own setting at its steps."""

import pytest
import torch

from nextserve import LLM, SamplingParams
from nextserve.config import ConfigError
from nextserve.engine_config import EngineConfig
from nextserve.ops import pdl as common
from nextserve.ops.pdl import set_pdl
from nextserve.ops.triton.common import launch_pdl, pdl_args


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_pdl_must_be_a_bool(bad) -> None:
    with pytest.raises(ConfigError, match="pdl"):
        EngineConfig(pdl=bad)


def test_cpu_tensors_never_launch_with_pdl() -> None:
    try:
        set_pdl(True)
        assert not launch_pdl(torch.zeros(1))
        assert pdl_args(torch.zeros(1)) == {"PDL": False, "launch_pdl": False}
    finally:
        set_pdl(False)


def test_each_engine_steps_with_its_own_setting(tiny_model_dir, monkeypatch) -> None:
    """Each step runs under its engine's setting, and leaves the process's switch as it found it."""
    seen: list[bool] = []
    real = common.pdl_mode
    monkeypatch.setattr("nextserve.runtime.runner.pdl_mode", lambda on: (seen.append(on), real(on))[1])
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    on = LLM(tiny_model_dir, device="cpu", pdl=True, max_concurrency=1)
    off = LLM(tiny_model_dir, device="cpu", pdl=False, max_concurrency=1)
    assert on.generate([[5, 6, 7]], params)[0].token_ids == off.generate([[5, 6, 7]], params)[0].token_ids
    assert True in seen and False in seen
    n = len(seen)
    on.generate([[5, 6]], params)
    assert set(seen[n:]) == {True}
    assert common._PDL[0] is False  # nothing leaked


def test_pdl_mode_restores() -> None:
    with common.pdl_mode(True):
        assert common._PDL[0] is True
        with common.pdl_mode(False):
            assert common._PDL[0] is False
        assert common._PDL[0] is True
    assert common._PDL[0] is False
