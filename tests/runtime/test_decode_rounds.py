"""The decode groups' bookkeeping (runtime/decode_rounds.py): round-robin groups, how many tokens a row
may take in a step, when a row stops, and the results the engine commits."""

from nextserve import SamplingParams
from nextserve.engine.scheduler import Chunk
from nextserve.engine.sequence import Sequence
from nextserve.runtime.decode_rounds import DecodeRounds, round_limit
from nextserve.runtime.runner import ChunkResult


def _chunk(start: int, out: int, max_tokens=None, max_context=100, constraint=None, stops=()):
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stops))
    seq = Sequence("r", list(range(start + 1 - out)), params, max_context=max_context)
    seq.output_ids, seq.constraint = [0] * out, constraint
    seq.token_at = lambda p: 1000 + p
    return Chunk(seq, start, start + 1, True)


def test_round_limits() -> None:
    assert round_limit(_chunk(10, 1), 4) == 4
    assert round_limit(_chunk(10, 1, max_tokens=3), 4) == 2  # 2 tokens left
    assert round_limit(_chunk(10, 1, max_context=13), 4) == 2  # positions 11, 12 left
    assert round_limit(_chunk(10, 1, constraint=object()), 4) == 1  # its grammar advances at update
    assert round_limit(_chunk(10, 1, max_tokens=1), 4) == 1  # never below one


def test_groups_rounds_and_results() -> None:
    chunks = [_chunk(10 + i, 1, stops=[7] if i == 2 else ()) for i in range(5)]
    rounds = DecodeRounds(chunks, 2, eos=99)
    assert [[r.chunk for r in g] for g in rounds.groups] == [chunks[0::2], chunks[1::2]]
    g0, g1 = rounds.groups
    assert [r.token for r in g0] == [1010, 1012, 1014] and [r.position for r in g0] == [10, 12, 14]
    rounds.record(g0, [ChunkResult(r.chunk, t) for r, t in zip(g0, [5, 7, 99], strict=True)])
    assert [r.done for r in g0] == [False, True, True]  # a stop token, then eos
    assert rounds.active(g0) == [g0[0]] and g0[0].token == 5 and g0[0].position == 11
    rounds.record(rounds.active(g0), [ChunkResult(g0[0].chunk, 6)])
    assert g0[0].done  # its limit: 2 rounds
    rounds.fail(g1, "boom")
    res = {id(r.chunk): r for r in rounds.results()}
    first = res[id(chunks[0])]
    assert (first.token, [t for t, _ in first.more], first.computed) == (5, [6], 12)
    assert res[id(chunks[4])].token == 99 and res[id(chunks[4])].computed == 15
    assert res[id(chunks[1])].error == "boom" and res[id(chunks[3])].error == "boom"
