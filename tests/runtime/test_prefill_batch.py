"""--prefill-batch-chunks: several prompt chunks in one forward (of one prompt, or of several), each
computed as it is alone (FlashNext.forward_chunks), so every output equals the serial reference (C1)."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import TINY, hf_model, new_sequence, nextserve_model
from pool_check import assert_pool_full

from nextserve import SamplingParams
from nextserve.config import ConfigError
from nextserve.engine_config import EngineConfig
from nextserve.model.batch import ForwardBatch, SeqChunk
from nextserve.runtime.runner import prefill_groups
from nextserve.step_plan import Chunk

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11, logprobs=1)


@pytest.fixture(scope="module")
def tiny():
    return nextserve_model(hf_model(TINY, seed=7, dtype=torch.float32), torch.float32)


def _ids(n: int, seed: int) -> torch.Tensor:
    ids = torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed))
    ids[[i for i in (3, 4, 17) if i < n]] = 1  # eos inside (the PLE n-gram resets), one on a chunk's 2nd row
    return ids


def _batch(ids: torch.Tensor, seq, s: int, e: int) -> ForwardBatch:
    return ForwardBatch(ids[s:e], torch.arange(s, e), [SeqChunk(seq, s, e - s)], False)


def test_forward_chunks_equals_each_chunk_alone(tiny) -> None:
    """Two chunks of one sequence and one of another in one forward_chunks: each chunk's streams, and the
    states they leave (read by the next chunk of each sequence), equal those of the chunks run one by one."""
    cfg, model = tiny
    a, b = _ids(48, 1), _ids(48, 2)
    alone = {"a": new_sequence(cfg, torch.float32, 48), "b": new_sequence(cfg, torch.float32, 48)}
    together = {"a": new_sequence(cfg, torch.float32, 48), "b": new_sequence(cfg, torch.float32, 48)}
    with torch.no_grad():
        ref = [model(_batch(a, alone["a"], 0, 16)), model(_batch(a, alone["a"], 16, 32))]
        ref.append(model(_batch(b, alone["b"], 0, 16)))
        outs = model.forward_chunks(
            [
                _batch(a, together["a"], 0, 16),
                _batch(a, together["a"], 16, 32),
                _batch(b, together["b"], 0, 16),
            ]
        )
        for r, o in zip(ref, outs, strict=True):
            assert torch.equal(r, o)
        # the states each sequence was left with: its next chunk reads them
        for name, ids, s in (("a", a, 32), ("b", b, 16)):
            nxt = model(_batch(ids, alone[name], s, s + 16))
            assert torch.equal(nxt, model(_batch(ids, together[name], s, s + 16)))


def test_prefill_groups_keep_the_plan_order() -> None:
    """Runs of consecutive chunks of equal length are one forward each; nothing is reordered, so a
    sequence's chunks run in order."""

    def ch(name: str, start: int, end: int) -> Chunk:
        return Chunk(name, start, end, sample=False)  # type: ignore[arg-type] (only the span is read)

    plan = [ch("a", 0, 16), ch("a", 16, 32), ch("b", 0, 16), ch("b", 16, 21), ch("c", 0, 5), ch("a", 32, 48)]
    groups = prefill_groups(plan)
    assert [[(c.seq, c.start) for c in g] for g in groups] == [
        [("a", 0), ("a", 16), ("b", 0)],
        [("b", 16), ("c", 0)],
        [("a", 32)],
    ]
    assert prefill_groups([]) == []


def _prompts() -> list[list[int]]:
    # one run of four full chunks to its image point (70 -> 64), chunks of several prompts at once, two
    # 5-token prompts (equal length: one forward), a prompt on the grid, one of a single token
    return [_ids(n, 10 + n).tolist() for n in (70, 5, 5, 48, 33, 1, 16)]


def test_batched_prefill_equals_serial(oracle_llm, solo_run) -> None:
    # (four chunks a step beside decodes too: the forwards of several chunks mixed with decode rows)
    llm = oracle_llm(
        prefill_batch_chunks=4, prefill_chunks_beside_decodes=4, prefix_cache_images=8, max_concurrency=8
    )
    groups = []
    forward_chunks = llm.engine.runner.model.forward_chunks

    def watched(batches):
        groups.append(len(batches))
        return forward_chunks(batches)

    llm.engine.runner.model.forward_chunks = watched
    prompts = _prompts()
    params = [GREEDY if i % 2 == 0 else SEEDED for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert max(groups) == 4 and len(groups) >= 3, groups  # several forwards of several chunks ran
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        ref = solo_run(prompt, p)
        assert out.error is None and out.token_ids == ref.token_ids
        assert [lp.logprob for lp in out.logprobs] == [lp.logprob for lp in ref.logprobs]
        assert [lp.top for lp in out.logprobs] == [lp.top for lp in ref.logprobs]
    # a second turn resumes from the first's image and runs its next chunks together
    turn2 = prompts[0] + outs[0].token_ids + _ids(40, 99).tolist()
    (again,) = llm.generate([turn2], GREEDY)
    assert again.cached_tokens == 64
    ref = solo_run(turn2, GREEDY)
    assert again.token_ids == ref.token_ids
    assert [lp.logprob for lp in again.logprobs] == [lp.logprob for lp in ref.logprobs]
    llm.engine.clear_prefix_cache()
    assert_pool_full(llm)


def test_a_failed_group_fails_its_requests_only(oracle_llm) -> None:
    """A forward of several chunks that raises ends the requests in it; the server goes on (C2)."""
    llm = oracle_llm(prefill_batch_chunks=2, max_concurrency=4)
    model = llm.engine.runner.model
    forward_chunks, calls = model.forward_chunks, [0]

    def broken(batches):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected")
        return forward_chunks(batches)

    model.forward_chunks = broken
    outs = llm.generate([_ids(5, 1).tolist(), _ids(5, 2).tolist()], GREEDY)
    assert all(o.finish_reason == "error" and "injected" in o.error for o in outs)
    (ok,) = llm.generate([_ids(40, 3).tolist()], GREEDY)
    assert ok.error is None and len(ok.token_ids) == GREEDY.max_tokens
    assert_pool_full(llm)


@pytest.mark.parametrize("bad", [0, 65, -1, "4", "", True, 2.0, None])
def test_prefill_batch_chunks_bad_values(bad) -> None:
    with pytest.raises(ConfigError, match="prefill_batch_chunks"):
        EngineConfig(prefill_batch_chunks=bad)


def test_prefill_batch_chunks_limits_and_stages() -> None:
    assert EngineConfig().prefill_chunks_per_step() == 4  # auto in one process: 16,384 tokens a forward
    assert EngineConfig(prefill_chunk=1024).prefill_chunks_per_step() == 16
    assert EngineConfig(prefill_chunk=16384).prefill_chunks_per_step() == 1
    assert EngineConfig(prefill_chunk=65536).prefill_chunks_per_step() == 1
    assert EngineConfig(prefill_chunk=16).prefill_chunks_per_step() == 64
    assert EngineConfig(prefill_batch_chunks=1).prefill_chunks_per_step() == 1
    assert EngineConfig(prefill_batch_chunks=64).prefill_chunks_per_step() == 64
    with pytest.raises(ConfigError, match="pipeline stages"):
        EngineConfig(prefill_batch_chunks=2, pipeline_stages=2)
    assert EngineConfig(pipeline_stages=2).prefill_chunks_per_step() == 2  # (auto: one per stage)
    assert EngineConfig(pipeline_stages=2, prefill_batch_chunks=1).prefill_chunks_per_step() == 2


def test_the_flag_reaches_the_engine_config() -> None:
    from nextserve.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["serve", "--prefill-batch-chunks", "4"])
    assert engine_config_from_args(args).prefill_batch_chunks == 4


def test_headroom_grows_with_the_chunks_of_a_forward(oracle_config) -> None:
    from nextserve.engine.memory_plan import headroom_bytes

    one = headroom_bytes(
        EngineConfig(prefill_chunk=64, prefill_batch_chunks=1), oracle_config, torch.bfloat16
    )
    four = headroom_bytes(
        EngineConfig(prefill_chunk=64, prefill_batch_chunks=4), oracle_config, torch.bfloat16
    )
    assert one == EngineConfig().memory_headroom_mib * 2**20 and four > one
    auto = headroom_bytes(EngineConfig(prefill_chunk=4096), oracle_config, torch.bfloat16)  # 4 chunks
    explicit = EngineConfig(prefill_chunk=4096, prefill_batch_chunks=4)
    assert auto == headroom_bytes(explicit, oracle_config, torch.bfloat16) > one
    stages = EngineConfig(prefill_chunk=64, pipeline_stages=2)
    assert headroom_bytes(stages, oracle_config, torch.bfloat16) == one
    assert (four - one) % (3 * 64) == 0  # three more chunks' activations, per token
