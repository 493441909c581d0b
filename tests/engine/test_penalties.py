"""Penalties, min_p and logit_bias: their effect on a row of logits (vLLM's and OpenAI's meanings), their
wrong values, the history they read (prompt and output so far, and a verify window's earlier drafts), and
the same outputs alone, batched, and speculating (C1)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from pool_check import assert_pool_full
from spec_cases import OracleProposer, same, spec_prompts

from nextserve import LLM, SamplingParams
from nextserve.engine import penalties
from nextserve.engine.penalties import TokenTally, adjust_logits
from nextserve.engine.sampling import sample_row

FLAGS = dict(
    device="cpu", dtype="float32", prefill_chunk=16, page_size=16, kv_capacity=4096, max_concurrency=3
)


def test_presence_and_frequency_penalties_subtract_per_output_token():
    tally = TokenTally([7, 7, 8], 10)  # the prompt counts for repetition only
    for t in (1, 1, 1, 2):
        tally.add(t)
    logits = torch.arange(10, dtype=torch.float32)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = adjust_logits(logits, p, tally)
    want = logits.clone()
    want[1] -= 0.5 + 3 * 0.25
    want[2] -= 0.5 + 1 * 0.25
    assert torch.equal(out, want)
    # a window's earlier drafts count as output
    out = adjust_logits(logits, p, tally, extra=(2, 5))
    want[2] -= 0.25
    want[5] -= 0.5 + 0.25
    assert torch.equal(out, want)
    assert tally.counts[5] == 0  # the tally itself is unchanged


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    tally = TokenTally([1, 2], 6)
    tally.add(3)
    logits = torch.tensor([2.0, 2.0, -2.0, 4.0, -4.0, 1.0])
    out = adjust_logits(logits, SamplingParams(repetition_penalty=2.0), tally)
    assert out.tolist() == [2.0, 1.0, -4.0, 2.0, -4.0, 1.0]


def test_logit_bias_adds_to_the_named_tokens():
    p = SamplingParams(temperature=0, logit_bias={3: 100.0, 0: -100})
    logits = torch.tensor([5.0, 1.0, 0.0, -1.0])
    assert adjust_logits(logits, p, None).tolist() == [-95.0, 1.0, 0.0, 99.0]
    assert sample_row(logits, p, torch.Generator())[0] == 3


def test_min_p_drops_the_unlikely_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = SamplingParams(temperature=1.0, min_p=0.35, seed=0)  # keeps p >= 0.175: tokens 0 and 1
    g = torch.Generator().manual_seed(0)
    seen = {sample_row(logits, p, g)[0] for _ in range(300)}
    assert seen == {0, 1}
    assert {sample_row(logits, SamplingParams(temperature=1.0), g)[0] for _ in range(300)} == {0, 1, 2, 3}


def test_logprobs_are_of_the_model_logits():
    logits = torch.tensor([3.0, 1.0, 0.0])
    _, lp = sample_row(
        logits, SamplingParams(temperature=0, logit_bias={2: 50}, logprobs=1), torch.Generator()
    )
    assert lp.token_id == 2 and math.isclose(
        lp.logprob, float(torch.log_softmax(logits, -1)[2]), rel_tol=1e-6
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.1),
        ("frequency_penalty", float("nan")),
        ("frequency_penalty", "1"),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.5),
        ("repetition_penalty", True),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {1: 101.0}),
        ("logit_bias", {"a": 1.0}),
        ("logit_bias", [(1, 2, 3)]),
    ],
)
def test_wrong_values_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [("presence_penalty", 2.0), ("presence_penalty", -2.0), ("repetition_penalty", 2.0), ("min_p", 1.0)],
)
def test_values_at_the_limits_are_taken(field, value):
    SamplingParams(**{field: value})


def test_tiny_temperatures_are_greedy():
    logits = torch.tensor([0.0, 3.0, 2.9])
    for t in (1e-39, 1e-6, 0.0):
        assert SamplingParams(temperature=t).greedy
        assert sample_row(logits, SamplingParams(temperature=t), torch.Generator())[0] == 1
    assert not SamplingParams(temperature=1e-5).greedy


PENALIZED = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.8, logprobs=1),
    SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True, presence_penalty=1.5,
                   frequency_penalty=0.7, min_p=0.05),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=2.0,
                   logit_bias={9: 3.0, 10: -2.0}),
]  # fmt: skip


def test_the_tally_is_the_history(small_model_dir, monkeypatch):
    """Every penalized row sees the prompt and the tokens before it: in plain decode and in verify windows,
    where a row's earlier drafts come as `extra` (row i of the output samples its i-th token)."""
    prompt = spec_prompts()[0]
    params = PENALIZED[1]
    calls = []
    real = penalties.adjust_logits

    def spy(logits, p, tally, extra=()):
        counts, seen = tally.with_extra(extra)
        calls.append((counts.clone(), seen.clone(), extra))
        return real(logits, p, tally, extra)

    def check(tokens: list[int]) -> None:
        assert len(calls) == len(tokens)
        V = calls[0][0].numel()
        for i, (counts, seen, _) in enumerate(calls):
            history = torch.tensor(tokens[:i], dtype=torch.long)
            assert torch.equal(counts, torch.bincount(history, minlength=V).int())
            want = torch.zeros(V, dtype=torch.bool).index_fill(0, torch.tensor(prompt + tokens[:i]), True)
            assert torch.equal(seen, want)

    monkeypatch.setattr("nextserve.engine.sampling.adjust_logits", spy)
    serial = LLM(str(small_model_dir), **FLAGS).generate([prompt], params)[0]
    check(serial.token_ids)
    calls.clear()
    llm = LLM(str(small_model_dir), speculative_method="ngram", speculative_tokens=4, **FLAGS)
    llm.engine.scheduler.proposer = OracleProposer([prompt], [serial.token_ids], 4, lambda i: i % 5 == 3)
    assert llm.generate([prompt], params)[0].token_ids == serial.token_ids
    check(serial.token_ids)
    assert any(extra for _, _, extra in calls)  # rows inside verify windows


@pytest.mark.parametrize("params", PENALIZED, ids=["repetition", "presence-frequency-min-p", "bias"])
def test_penalized_outputs_are_the_same_alone_batched_and_speculating(small_model_dir, params):
    prompts = spec_prompts()
    alone = [
        LLM(str(small_model_dir), **FLAGS | {"max_concurrency": 1}).generate([p], params)[0] for p in prompts
    ]
    neutral = dict(logit_bias=(), repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    plain = LLM(str(small_model_dir), **FLAGS).generate(prompts, dataclasses.replace(params, **neutral))
    assert any(a.token_ids != b.token_ids for a, b in zip(alone, plain, strict=True))  # the penalty acts
    same(alone, LLM(str(small_model_dir), **FLAGS).generate(prompts, params))  # batched
    for wrong in (lambda i: False, lambda i: i % 3 == 1):
        llm = LLM(str(small_model_dir), speculative_method="ngram", speculative_tokens=3, **FLAGS)
        llm.engine.scheduler.proposer = OracleProposer(prompts, [o.token_ids for o in alone], 3, wrong)
        same(alone, llm.generate(prompts, params))
        assert assert_pool_full(llm)["spec_draft_tokens"] > 0
