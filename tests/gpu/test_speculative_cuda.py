"""Speculative decoding on the GPU: a verify window's rows get serial decode's bits (decode replayed as
CUDA graphs, the window eager), and a speculating engine gives the serial reference's outputs (C1), with
drafts from an oracle (ngram method) or from the model's MTP block (mtp method)."""

import pytest
import torch
from pool_check import assert_pool_full
from spec_cases import (
    PY_PROMPT,
    DraftLog,
    OracleProposer,
    check_window_batch,
    check_window_rows,
    mtp_drafts_resumed_as_cold,
    py_prompts,
    same,
    spec_prompts,
)

from nextserve import LLM, SamplingParams
from nextserve.engine_config import DEFAULT_MODEL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def no_lost_drafts(caplog):
    """A failed MTP run only loses its drafts (outputs stay right), so the output checks cannot see it."""
    yield
    lost = [r for r in caplog.records if r.getMessage() == "MTP drafting failed"]
    assert not lost, lost[0].exc_text


FLAGS = dict(
    device="cuda", dtype="bfloat16", prefill_chunk=16, page_size=16, kv_capacity=4096, max_concurrency=3
)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_window_rows_equal_serial_decode(small_model_dir, dtype: str) -> None:
    check_window_rows(small_model_dir, FLAGS | {"dtype": dtype})


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_window_batch_rows_and_rewinds_equal_serial_decode(small_model_dir, dtype: str, graph: bool) -> None:
    """Three windows (5, 3, 2 rows) replayed as one CUDA graph (bucket 4 x 5) or run eagerly: rows up to
    the first wrong draft equal serial decode's logits (decode graphs), every slot ends in serial decode's
    state, rewound from its keep slot or not."""
    check_window_batch(small_model_dir, FLAGS | {"dtype": dtype, "cuda_graph": graph}, graph=graph)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2),
     SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=5, ignore_eos=True, logprobs=1)],
    ids=["greedy", "seeded"],
)  # fmt: skip
def test_speculation_gives_the_serial_outputs(small_model_dir, params) -> None:
    prompts = spec_prompts()
    serial = LLM(str(small_model_dir), **FLAGS).generate(prompts, params)
    llm = LLM(str(small_model_dir), speculative_method="ngram", speculative_tokens=4, **FLAGS)
    llm.engine.scheduler.proposer = OracleProposer(
        prompts, [o.token_ids for o in serial], 4, lambda i: i % 5 == 3
    )
    same(serial, llm.generate(prompts, params))
    assert llm.stats()["spec_accepted_tokens"] > 0


MTP_PARAMS = [
    SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=32, temperature=0.8, top_k=20, seed=5, ignore_eos=True, logprobs=1),
]


@pytest.mark.parametrize("params", MTP_PARAMS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("dtype,k", [("bfloat16", 1), ("bfloat16", 4), ("float32", 4)])
def test_mtp_speculation_gives_the_serial_outputs(params, dtype, k) -> None:
    """The trained default model's MTP drafts (often right, sometimes wrong), three concurrent prompts
    over several prefill chunks: the serial outputs; decodes, verify windows and the MTP's windows replay
    graphs (the MTP's rows of a prefill chunk run eagerly)."""
    prompts, flags = py_prompts(), FLAGS | {"dtype": dtype, "prefill_chunk": 32}
    serial = LLM(DEFAULT_MODEL, **flags).generate(prompts, params)
    llm = LLM(DEFAULT_MODEL, speculative_method="mtp", speculative_tokens=k, **flags)
    same(serial, llm.generate(prompts, params))
    s = assert_pool_full(llm)
    assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"], s


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mtp_graphs_draft_as_eager(dtype: str) -> None:
    """The MTP drafter's graphs (committed rows and chains per (rows, bucket)) propose the drafts its eager
    path proposes, window by window, and the outputs are the same."""
    prompts, flags = py_prompts(), FLAGS | {"dtype": dtype, "prefill_chunk": 32}
    params = MTP_PARAMS[0]
    runs = []
    for graph in (False, True):
        llm = LLM(DEFAULT_MODEL, speculative_method="mtp", speculative_tokens=3, cuda_graph=graph, **flags)
        drafts, replays = DraftLog(llm), []
        graphs = llm.engine.runner.graphs
        if graph:
            replay = graphs.replay_mtp
            graphs.replay_mtp = lambda *a, replay=replay, replays=replays: replays.append(1) or replay(*a)
        runs.append((llm.generate(prompts, params), drafts.log, len(replays)))
    (eager_out, eager_log, _), (graph_out, graph_log, n_replays) = runs
    same(eager_out, graph_out)
    assert graph_log == eager_log and n_replays > 0


def test_mtp_speculation_on_a_random_model(small_model_dir) -> None:
    prompts, params = spec_prompts(), MTP_PARAMS[1]
    serial = LLM(str(small_model_dir), **FLAGS).generate(prompts, params)
    llm = LLM(str(small_model_dir), speculative_method="mtp", speculative_tokens=3, **FLAGS)
    same(serial, llm.generate(prompts, params))
    assert llm.stats()["spec_draft_tokens"] > 0


def test_mtp_acceptance_on_the_default_model() -> None:
    """128 greedy tokens after a Python prompt, K=1: the serial tokens, and most drafts accepted (the CPU
    float32 run accepts 49 of 79; bfloat16 follows another greedy path, so the bound is loose)."""
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    flags = FLAGS | {"prefill_chunk": 64}
    serial = LLM(DEFAULT_MODEL, **flags).generate([PY_PROMPT], params)
    llm = LLM(DEFAULT_MODEL, speculative_method="mtp", speculative_tokens=1, **flags)
    same(serial, llm.generate([PY_PROMPT], params))
    s = llm.stats()
    assert s["spec_accepted_tokens"] > 0.4 * s["spec_draft_tokens"], s


def test_mtp_with_prefix_reuse_on_cuda(small_model_dir) -> None:
    """Resumed requests: the serial outputs and the drafts of a cold engine (same as the CPU test)."""
    base = spec_prompts()[2]
    prompts = [base, base[:48] + [7, 8, 9], base + [11, 12]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    _, warm = mtp_drafts_resumed_as_cold(small_model_dir, FLAGS, prompts, params)
    assert_pool_full(warm)
