"""Pipeline windows (--pipeline-windows; runtime/pipeline_windows.py; CPU, Gloo): while the last stage
verifies a request's window, the front stages run the MTP-guessed next window on a shadow slot; a held
guess is committed, a dropped one forgotten. Outputs are the serial ones (C1), greedy and seeded, with 2
and 3 stages, decode groups, the head's embeddings on the host, prefix images, max_tokens inside a guessed
window and requests decoding together (no guesses then); the stages' trace shows the guessed windows on
the front stage beside the last stage's verify; held and dropped guesses are counted (stats, /metrics);
and the rules of a pair (sampling, where its state is committed from, its inputs) on their own."""

import json

import pytest
import torch
from pool_check import assert_pool_full
from spec_cases import PY_PROMPT, py_prompts, same

from nextserve import LLM, SamplingParams
from nextserve.config import ConfigError, ModelConfig
from nextserve.engine.sampling import SamplingParams as Params
from nextserve.engine_config import DEFAULT_MODEL, EngineConfig
from nextserve.runtime.pipeline_windows import commit_location, mtp_tokens, pair_chunk, sample_pair
from nextserve.runtime.windows import sample_window
from nextserve.step_plan import Chunk

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # stage processes share 2 cores

FLAGS = dict(
    device="cpu", dtype="float32", prefill_chunk=32, page_size=16, kv_capacity=4096, max_concurrency=3
)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=5, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def serial() -> LLM:
    return LLM(DEFAULT_MODEL, **FLAGS)


def _windows(k: int, **extra) -> LLM:
    flags = dict(speculative_method="mtp", speculative_tokens=k, pipeline_stages=2, pipeline_windows=True)
    return LLM(DEFAULT_MODEL, **flags | FLAGS | extra)


@pytest.mark.parametrize(
    "k,extra",
    [(1, {}), (3, {"decode_groups": 2, "head_embedding": "host"}), (2, {"pipeline_stages": 3})],
    ids=["2-k1", "2-k3-groups-host", "3-k2"],
)
def test_pipeline_windows_give_the_serial_outputs(serial: LLM, k: int, extra: dict) -> None:
    """The trained default model (its MTP guesses often right, often wrong): each prompt alone (guessed
    windows; the shorter prompt resumes from the longer one's prefix image), greedy and seeded, then all
    three at once (no guesses: several decode); the serial outputs, guesses both held and dropped, and the
    pool full again."""
    prompts = [serial.tokenizer.encode(p, add_special_tokens=False) for p in py_prompts()]
    split = _windows(k, **extra)
    try:
        for params in (GREEDY, SEEDED):
            for p in prompts:
                same(serial.generate([p], params), split.generate([p], params))
        s = split.stats()
        assert s["pipeline_windows_held"] > 0 and s["pipeline_windows_dropped"] > 0, s
        assert s["prefix_hits"] > 0, s
        same(serial.generate(prompts, GREEDY), split.generate(prompts, GREEDY))
        assert split.stats()["pipeline_windows_held"] + split.stats()["pipeline_windows_dropped"] >= (
            s["pipeline_windows_held"] + s["pipeline_windows_dropped"]
        )  # fmt: skip
        s = assert_pool_full(split)
        assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"], s
    finally:
        split.close()


def test_max_tokens_inside_a_guessed_window(serial: LLM) -> None:
    """Requests whose budget ends inside a pair (K=2, max_tokens 3 to 9: the guess cut short by it, or
    none): the serial outputs."""
    prompt = serial.tokenizer.encode(PY_PROMPT, add_special_tokens=False)
    split = _windows(2)
    try:
        for n in range(3, 10):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            same(serial.generate([prompt], params), split.generate([prompt], params))
        assert split.stats()["pipeline_windows_held"] > 0
        assert_pool_full(split)
    finally:
        split.close()


def test_the_front_stage_runs_guesses_while_the_last_verifies(serial: LLM, tmp_path, monkeypatch) -> None:
    """The stages' own trace (NEXTSERVE_STAGE_TRACE): stage 0 ran every guessed window (held + dropped),
    the last stage only the held ones, and a guessed window on stage 0 ran while the last stage computed a
    verify window; the counters reach /metrics."""
    from prometheus_client import CollectorRegistry, generate_latest

    from nextserve.runtime.stage_worker import TRACE_ENV
    from nextserve.server.metrics import _EngineCollector

    monkeypatch.setenv(TRACE_ENV, str(tmp_path))
    prompt = serial.tokenizer.encode(PY_PROMPT, add_special_tokens=False)
    split = _windows(2)
    try:
        same(serial.generate([prompt], GREEDY), split.generate([prompt], GREEDY))
        s = split.stats()
        registry = CollectorRegistry()
        registry.register(_EngineCollector(split.stats))
        text = generate_latest(registry).decode()
    finally:
        split.close()
    held, dropped = s["pipeline_windows_held"], s["pipeline_windows_dropped"]
    assert f"nextserve_pipeline_windows_held_total {float(held)}" in text
    assert f"nextserve_pipeline_windows_dropped_total {float(dropped)}" in text
    trace = [[json.loads(line) for line in open(tmp_path / f"stage-{r}.jsonl")] for r in (0, 1)]
    guesses = [[e for e in t if e["kind"] == "guess"] for t in trace]
    assert len(guesses[0]) == held + dropped and len(guesses[1]) == held > 0
    verifies = [e for e in trace[1] if e["kind"] == "windows"]
    assert any(g["start"] < v["end"] and v["start"] < g["end"] for g in guesses[0] for v in verifies)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"pipeline_windows": True}, "needs pipeline_stages > 1"),
        ({"pipeline_windows": True, "pipeline_stages": 2}, "speculative_method mtp"),
        ({"pipeline_windows": True, "pipeline_stages": 2, "speculative_method": "ngram"}, "method mtp"),
        ({"pipeline_windows": "yes"}, "pipeline_windows must be true or false"),
    ],
)
def test_pipeline_windows_bad_values(kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineConfig(model="m", **kw)


def test_the_flag_and_the_chain() -> None:
    """--pipeline-windows reaches the config; the MTP chain is then 2k + 1 long, with one state slot more
    (the shadow) than requests."""
    from nextserve.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(
        ["serve", "--pipeline-stages", "2", "--speculative-method", "mtp", "--speculative-tokens", "3",
         "--pipeline-windows", "--max-concurrency", "5"]
    )  # fmt: skip
    config = engine_config_from_args(args)
    assert config.pipeline_windows and mtp_tokens(config) == 7 and config.state_slots == 6
    plain = EngineConfig(
        model="m", pipeline_stages=2, speculative_method="mtp", speculative_tokens=3, max_concurrency=4
    )
    assert mtp_tokens(plain) == 3 and plain.state_slots == plain.max_concurrency


# ---- the rules of a window and its guess, on their own ------------------------------------------------
class _Seq:
    """What sample_pair reads of a sequence: its params and its sampler."""

    def __init__(self, params: Params) -> None:
        self.params, self.generator = params, torch.Generator().manual_seed(7)
        self.constraint = self.tally = None

    def sample(self, logits, extra=()):
        from nextserve.engine.sampling import sample_row

        return sample_row(logits, self.params, self.generator, None, None, extra)


def _logits(tokens: list[int], V: int = 16) -> torch.Tensor:
    """Rows [n, V] whose argmax is each of tokens."""
    out = torch.zeros(len(tokens), V)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return out


@pytest.mark.parametrize(
    "first,second_rows,want,held",
    [
        ([3, 9, 6], None, [3, 9], False),  # draft 2 (4) wrong: the window stops there
        ([3, 4, 6], None, [3, 4, 6], False),  # all held but 6 is not the guess's 5: dropped
        ([3, 4, 5], [6, 7, 8], [3, 4, 5, 6, 7, 8], True),  # the pair held all through
        ([3, 4, 5], [6, 0, 8], [3, 4, 5, 6, 0], True),  # the guess's second draft (7) wrong
        ([3, 1, 5], None, [3, 1], False),  # eos (1) is a wrong draft here anyway
    ],
)
def test_sample_pair_greedy(first, second_rows, want, held) -> None:
    """Window [t, 3, 4] and guess [5, 6, 7]: rows sampled in order, the guess's rows asked for only when
    the window held and chose 5."""
    seq = _Seq(Params(temperature=0.0))
    ch = Chunk(seq, 10, 13, sample=True, drafts=(3, 4), guess=(5, 6, 7))
    asked = []

    def second():
        asked.append(1)
        return _logits(second_rows)

    rows, got_held = sample_pair(ch, _logits(first), second, eos=1)
    assert [t for t, _ in rows] == want and got_held == held and len(asked) == int(held)


def test_sample_pair_drops_the_guess_after_an_end_token() -> None:
    """A window whose accepted tokens include eos (not ignored) ends the request: the guess is not run."""
    ch = Chunk(_Seq(Params(temperature=0.0)), 10, 13, sample=True, drafts=(1, 4), guess=(5, 6))
    rows, held = sample_pair(ch, _logits([1, 4, 5]), lambda: pytest.fail("guess asked for"), eos=1)
    assert [t for t, _ in rows] == [1, 4, 5] and not held


def test_sample_pair_seeded_is_one_window_of_both() -> None:
    """Seeded sampling: the pair's rows are what sample_window draws over one window of drafts + guess
    with the same generator (each row sampled once, in order)."""
    torch.manual_seed(3)
    logits = torch.randn(7, 16) * 3
    drafts, guess = (4, 2, 9), (1, 5, 8)
    ch = Chunk(None, 10, 14, sample=True, drafts=drafts, guess=guess)
    p = Params(temperature=1.0, seed=3)
    for flip in range(8):  # some pairs held, some not
        a, b = _Seq(p), _Seq(p)
        a.generator.manual_seed(flip)
        b.generator.manual_seed(flip)
        rows, _ = sample_pair(Chunk(a, 10, 14, True, drafts, guess), logits[:4], lambda: logits[4:], None)
        want = sample_window(pair_chunk(Chunk(b, 10, 14, True, drafts, guess)),
                             lambda j, b=b: b.sample(logits[j], (drafts + guess)[:j]))  # fmt: skip
        assert rows == want
    assert pair_chunk(ch).end == 17 and pair_chunk(ch).drafts == drafts + guess and not pair_chunk(ch).guess


def test_commit_location() -> None:
    """Where a pair's state after its n-th committed row is: the window's keep slots, its slot, the
    guess's keep slots, the shadow slot."""
    from nextserve.cache.states import StateSlots

    cfg = ModelConfig.from_dir(DEFAULT_MODEL)
    states = StateSlots(cfg, 3, 1, torch.float32, window_steps=2)
    slot, shadow, keep = 0, 2, states.keep_slot
    got = [commit_location(states, slot, shadow, 3, 3, n) for n in range(1, 7)]
    assert got == [keep(slot, 0), keep(slot, 1), slot, keep(shadow, 0), keep(shadow, 1), shadow]
