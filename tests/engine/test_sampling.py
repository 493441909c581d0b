"""Sampler: top-k/top-p masks, seeded reproduction, logprobs, bad parameters."""

import pytest
import torch

from nextserve.engine.sampling import SamplingParams, filter_logits, sample_row


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    out = filter_logits(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(out).tolist() == [False, True, False, True, False]


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert torch.isfinite(filter_logits(logits, -1, 0.5)).tolist() == [True, False, False, False]
    assert torch.isfinite(filter_logits(logits, -1, 0.79)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, -1, 0.81)).tolist() == [True, True, True, False]
    assert torch.isfinite(filter_logits(logits, -1, 1.0)).all()


def test_seeded_sampling_reproduces_and_seeds_differ() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7)

    def draw(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return [sample_row(logits, p, g)[0] for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_greedy_and_logprobs() -> None:
    logits = torch.tensor([0.0, 2.0, 1.0])
    token, lp = sample_row(logits, SamplingParams(temperature=0, logprobs=2), torch.Generator())
    assert token == 1
    ref = torch.log_softmax(logits, -1)
    assert lp.token_id == 1 and lp.logprob == pytest.approx(ref[1].item())
    assert [t for t, _ in lp.top] == [1, 2]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0}, {"max_tokens": -1}, {"max_tokens": 1.5}, {"temperature": -0.1},
        {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"top_k": 1.5},
        {"seed": "x"}, {"logprobs": -1}, {"logprobs": 21}, {"stop": [""]}, {"stop": [1.5]},
        {"stop_token_ids": [-1]},
    ],
)  # fmt: skip
def test_bad_parameters_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_stop_accepts_strings_and_token_ids() -> None:
    p = SamplingParams(stop=["\n\n", 42])
    assert p.stop == ("\n\n",) and p.stop_token_ids == (42,)
