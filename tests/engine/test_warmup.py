"""The warm-up's requests (engine/warmup.py) on a CPU engine: the chunk-length kinds it runs fit
max_context, and it leaves the engine as if nothing ran (no images, counters at zero). Whether it compiles
everything is the GPU test tests/gpu/test_warm_up.py."""

from __future__ import annotations

import logging

import pytest

from nextserve import SamplingParams
from nextserve.engine.warmup import TAILS, moe_block_m, tail_lengths, warm_up
from nextserve.ops.gdn import FLA_MIN_TOKENS, fla_tune_class
from nextserve.ops.moe import default_block_m


@pytest.mark.parametrize("max_context,chunk", [(256, 16), (64, 64), (40, 16)])
def test_warm_up_runs_the_tails_that_fit_and_leaves_nothing(oracle_llm, caplog, max_context, chunk):
    llm = oracle_llm(max_context=max_context, prefill_chunk=chunk)
    with caplog.at_level(logging.INFO, logger="nextserve.engine"):
        assert warm_up(llm.engine) >= 0
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up:")]
    ran = [int(n) for n in line.split(" tokens)")[0].rsplit(", ", 1)[1].split("/")]
    assert ran and all(n < chunk or n == 1 for n in ran)
    warm_chunk = min(chunk, max(1, max_context - 32 - 4))  # (the warm-up's own chunk: it must fit)
    assert set(ran) <= set(tail_lengths(warm_chunk, moe_block_m(llm.engine.model))) | {1}
    stats = llm.stats()
    assert stats["prefix_images"] == 0 and stats["prefix_hits"] == 0 and stats["running"] == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert len(out.token_ids) == 2 and out.cached_tokens == 0


def test_warm_up_runs_chunks_together_with_prefill_batch_chunks(oracle_llm) -> None:
    llm = oracle_llm(max_context=256, prefill_chunk=16, prefill_batch_chunks=2)
    groups, forward_chunks = [], llm.engine.runner.model.forward_chunks
    llm.engine.runner.model.forward_chunks = lambda b: groups.append(len(b)) or forward_chunks(b)
    warm_up(llm.engine)
    assert groups == [2]
    assert llm.stats()["prefix_images"] == 0 and llm.stats()["running"] == 0


def test_tails_reach_past_the_fla_threshold() -> None:
    """A chunk longer than FLA_MIN_TOKENS meets fla at both specialisations (a multiple of 16 and not)."""
    long = [n for n in TAILS if n > FLA_MIN_TOKENS]
    assert {n % 16 == 0 for n in long} == {True, False}


def test_every_block_m_class_below_the_chunk_is_warmed() -> None:
    """At Flash-Next's widths (E=512, k=10, 4,096-token chunks) a chunk of any length compiles nothing the
    warm-up's lengths did not: its BLOCK_M, side of FLA_MIN_TOKENS and multiple-of-16-ness are a tail's."""
    block_m = lambda n: default_block_m(n * 10, 512)  # noqa: E731
    tails = tail_lengths(4096, block_m)
    kind = lambda n: (block_m(n), n >= FLA_MIN_TOKENS, n % 16 == 0)  # noqa: E731
    assert {kind(n) for n in range(2, 4096)} == {kind(n) for n in tails if n > 1}
    assert set(TAILS) <= set(tails) and 1 in tails and max(tails) < 4096
    assert {block_m(n) for n in tails} == {16, 32, 64, 128}
    assert tail_lengths(4096) == list(TAILS)  # no MoE layers: the fixed lengths


def test_every_fla_tune_class_below_a_long_chunk_is_warmed() -> None:
    """fla's L2 norm is autotuned per cdiv(tokens * key heads, 65,536): at Flash-Next's widths and
    --prefill-chunk 16384 an 8,192-token chunk is a class neither the chunk nor TAILS meets (it stalled a
    first 8K prompt on an H100); the 4,096-token default has one class below the chunk, as before."""
    block_m = lambda n: default_block_m(n * 10, 512)  # noqa: E731
    classes = lambda ns: {fla_tune_class(n, 16) for n in ns}  # noqa: E731
    tails = tail_lengths(16384, block_m, gdn_key_heads=16)
    assert classes(range(2, 16384)) == classes(tails) == {0, 1, 2, 3, 4}
    assert max(tails) < 16384 and set(TAILS) <= set(tails)
    assert fla_tune_class(8192, 16) not in classes([16384, *TAILS])  # what the warm-up ran before
    assert tail_lengths(4096, block_m, gdn_key_heads=16) == tail_lengths(4096, block_m)
    assert tail_lengths(4096, gdn_key_heads=16) == list(TAILS)


def test_the_warm_up_reads_the_models_experts(oracle_llm) -> None:
    llm = oracle_llm()
    moe = llm.engine.model_config
    block_m = moe_block_m(llm.engine.model)
    for n in (1, 17, 100, 1000):
        assert block_m(n) == default_block_m(n * moe.num_experts_per_tok, moe.num_experts)
