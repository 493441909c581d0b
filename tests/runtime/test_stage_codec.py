"""Step messages between pipeline stages travel as JSON (runtime/stage_codec.py): every step field
round-trips exactly, and what arrives can build only those values, never run code."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from nextserve.runtime import stage_codec
from nextserve.runtime.stage_worker import DecodeWork, PrefillWork, StageStep, WindowsWork


def test_a_step_round_trips():
    inputs = np.arange(5 * 3 * 2, dtype=np.int64).reshape(5, 3, 2) - 7
    step = StageStep(
        ops=[("copy_page", 3, 4), ("rewind", [1, 2], [5, 6]), ("unspill", 7, (8, 9), 10), ("drop", 2)],
        prefills=[PrefillWork(1, [0, 2], 64, [5, 6, 7], True)],
        decodes=(DecodeWork([1, -2], [10, 11], [0, 1], [[3], [4, 5]]),),
        windows=WindowsWork(inputs, [[1], [2, 3]]),
    )
    back = stage_codec.loads(stage_codec.dumps(step))
    assert back.ops == step.ops and back.prefills == step.prefills and back.decodes == step.decodes
    assert isinstance(back.decodes, tuple) and isinstance(back.ops[2][2], tuple)
    assert back.windows.inputs.dtype == np.int64 and np.array_equal(back.windows.inputs, inputs)
    assert back.windows.tables == step.windows.tables
    assert stage_codec.loads(stage_codec.dumps(None)) is None


class _Evil:
    def __reduce__(self):
        return (_ran.append, ("pwned",))


_ran: list[str] = []


def test_a_pickle_that_would_run_code_is_refused():
    payload = pickle.dumps(_Evil())
    with pytest.raises(ValueError):
        stage_codec.loads(payload)
    assert _ran == []


@pytest.mark.parametrize(
    "message",
    [
        b'{"t": "os.system", "v": {"command": "true"}}',
        b'{"t": "Popen", "v": ["true"]}',
        b'{"t": "StageStep"}',
    ],
)
def test_unknown_or_malformed_tags_are_refused(message):
    with pytest.raises((ValueError, TypeError)):
        stage_codec.loads(message)


def test_only_step_values_can_be_sent():
    with pytest.raises(TypeError):
        stage_codec.dumps(object())
    with pytest.raises(TypeError):
        stage_codec.dumps(np.zeros(2, dtype=np.float32))
