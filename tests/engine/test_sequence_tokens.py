"""Sequence.token_at / tokens read the context without copying it, and agree with all_ids."""

from nextserve.engine.sampling import SamplingParams
from nextserve.engine.sequence import Sequence


def test_token_reads_agree_with_all_ids() -> None:
    seq = Sequence("r", [5, 6, 7, 8], SamplingParams(max_tokens=8), max_context=64)
    seq.output_ids += [9, 10, 11]
    every = seq.all_ids
    assert [seq.token_at(i) for i in range(len(every))] == every
    for start in range(len(every)):
        for end in range(start, len(every) + 1):
            assert seq.tokens(start, end) == every[start:end], (start, end)
