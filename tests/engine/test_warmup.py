"""The warm-up's requests (engine/warmup.py) on a CPU engine: the chunk-length kinds it runs fit
max_context, and it leaves the engine as if nothing ran (no images, counters at zero). Whether it compiles
everything is the GPU test tests/gpu/test_warm_up.py."""

from __future__ import annotations

import logging

import pytest

from nextserve import SamplingParams
from nextserve.engine.warmup import TAILS, warm_up
from nextserve.ops.gdn import FLA_MIN_TOKENS


@pytest.mark.parametrize("max_context,chunk", [(256, 16), (64, 64), (40, 16)])
def test_warm_up_runs_the_tails_that_fit_and_leaves_nothing(oracle_llm, caplog, max_context, chunk):
    llm = oracle_llm(max_context=max_context, prefill_chunk=chunk)
    with caplog.at_level(logging.INFO, logger="nextserve.engine"):
        assert warm_up(llm.engine) >= 0
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up:")]
    ran = [int(n) for n in line.split(" tokens)")[0].rsplit(", ", 1)[1].split("/")]
    assert ran and all(n < chunk or n == 1 for n in ran) and set(ran) <= set(TAILS)
    stats = llm.stats()
    assert stats["prefix_images"] == 0 and stats["prefix_hits"] == 0 and stats["running"] == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert len(out.token_ids) == 2 and out.cached_tokens == 0


def test_tails_reach_past_the_fla_threshold() -> None:
    """A chunk longer than FLA_MIN_TOKENS meets fla at both specialisations (a multiple of 16 and not)."""
    long = [n for n in TAILS if n > FLA_MIN_TOKENS]
    assert {n % 16 == 0 for n in long} == {True, False}
