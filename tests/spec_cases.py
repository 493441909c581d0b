"""Shared by the speculative decoding tests (tests/engine, tests/gpu): prompts, drafts from the serial
reference, a log of what a proposer proposes, output comparison, and the check that a verify window's rows
equal serial decode."""

import torch

from nextserve import LLM, SamplingParams
from nextserve.engine.engine import LLMEngine
from nextserve.engine_config import EngineConfig
from nextserve.model.batch import ForwardBatch, SeqChunk

# The default model's speed-mode tests (int4 weights, int8 KV): engine flags besides the format, and requests
MODE_FLAGS = dict(device="cpu", dtype="float32", prefill_chunk=32, page_size=16, kv_capacity=4096)
MODE_PARAMS = [
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=20, temperature=0.9, top_k=20, seed=5, ignore_eos=True, logprobs=1),
]


def serial_reference(flags: dict, params: list[SamplingParams]) -> tuple[LLM, list[str], dict]:
    """(the LLM, py_prompts(), {i: outputs under params[i]}) of the default model's serial reference
    (max_concurrency 1) with engine `flags`, on one torch thread as the speed-mode tests run them
    (`one_torch_thread`: CPU GEMMs may split their sums by the thread count)."""
    from nextserve.engine_config import DEFAULT_MODEL

    prompts = py_prompts()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(DEFAULT_MODEL, max_concurrency=1, **flags)
        return llm, prompts, {i: llm.generate(prompts, p) for i, p in enumerate(params)}
    finally:
        torch.set_num_threads(threads)


def spec_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(8, 250, (n,), generator=g).tolist() for n in (37, 45, 61)]


# A Python prompt for the default model (trained on Python's stdlib): 128 greedy tokens after it.
PY_PROMPT = '''import os
import sys


def read_lines(path):
    """Return the lines of the file at path."""
    with open(path) as f:
        return f.read().splitlines()


def main(argv):
    for name in argv[1:]:
'''


class DraftLog:
    """Wraps the engine's proposer and records what it proposes: (prompt, position, drafts)."""

    def __init__(self, llm: LLM) -> None:
        self.inner, self.log = llm.engine.scheduler.proposer, []
        self.k = self.inner.k
        llm.engine.scheduler.proposer = self

    def guess(self, seq, limit: int) -> list[int]:
        return self.inner.guess(seq, limit)

    def drafts(self, seq, limit: int) -> list[int]:
        drafts = self.inner.drafts(seq, limit)
        self.log.append((tuple(seq.prompt_ids), seq.num_computed, tuple(drafts)))
        return drafts

    def of(self, prompt) -> list:
        return [(pos, d) for p, pos, d in self.log if p == tuple(prompt)]


def py_prompts() -> list[str]:
    """Three Python prompts of 2-4 prefill chunks (of 32 tokens) for the default model."""
    return [PY_PROMPT, PY_PROMPT[:150], "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
            "    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n"]  # fmt: skip


class OracleProposer:
    """Drafts from the serial reference's outputs, with the outputs at `wrong` indices changed."""

    def __init__(self, prompts, outputs, k: int, wrong) -> None:
        self.by_prompt = {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}
        self.k, self.wrong = k, wrong

    def drafts(self, seq, limit: int) -> list[int]:
        return self.propose(seq.all_ids, limit)

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        for prompt, out in self.by_prompt.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                drafts = out[done : done + min(self.k, limit)]
                return [(t + 1) % 256 if self.wrong(done + i) else t for i, t in enumerate(drafts)]
        raise AssertionError("unknown sequence")


def same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == y.finish_reason
        if x.logprobs is not None:
            assert [lp.logprob for lp in x.logprobs] == [lp.logprob for lp in y.logprobs]
            assert [lp.top for lp in x.logprobs] == [lp.top for lp in y.logprobs]


def check_window_rows(model_dir, flags: dict, k: int = 6) -> None:
    """Each row of a verify window of k rows after the second prompt equals serial decode's logits."""
    prompt = spec_prompts()[1]
    params = SamplingParams(max_tokens=k + 1, temperature=0.0, ignore_eos=True)
    serial = LLMEngine(
        EngineConfig(model=str(model_dir), **flags, async_scheduling=False)
    )  # decode_logits hooked
    steps = []
    decode = serial.runner.decode_logits
    serial.runner.decode_logits = lambda chunks: steps.append(decode(chunks)[0].clone()) or (steps[-1], None)
    rid = serial.add_request(prompt, params)
    while serial.has_unfinished():
        out = serial.step()
    tokens = next(o for o in out if o.request_id == rid).token_ids
    eng = LLMEngine(EngineConfig(model=str(model_dir), **flags))
    seq = eng.sequences[eng.add_request(prompt, params)]
    while not seq.output_ids:
        eng.step()
    start, dev = len(prompt), eng.device
    for p in range(start, start + k):
        seq.cache.own_page_at(p)
    with torch.inference_mode():
        ids, pos = torch.tensor(tokens[:k], device=dev), torch.arange(start, start + k, device=dev)
        streams = eng.model(ForwardBatch(ids, pos, [SeqChunk(seq.cache, start, k)], row_invariant=True))
        window = eng.model.logits(streams, row_invariant=True)
    assert len(steps) == k
    bad = [j for j, logits in enumerate(steps) if not torch.equal(window[j], logits[0])]
    assert not bad, f"window rows {bad} differ from serial decode"


def mtp_drafts_resumed_as_cold(
    model_dir, flags: dict, prompts, params, warm_flags: dict | None = None
) -> tuple[LLM, LLM]:
    """Each prompt alone on a cold MTP engine and on one keeping prefix images (later prompts resume; with
    `warm_flags` too, e.g. pipeline stages): both give the serial outputs, the resumed one reuses cached
    tokens and proposes the cold engine's drafts. Returns (cold, warm) for the caller's pool checks (and
    to close)."""
    serial = LLM(str(model_dir), **flags).generate(prompts, params)
    cold = LLM(str(model_dir), speculative_method="mtp", speculative_tokens=3, **flags)
    warm = LLM(str(model_dir), speculative_method="mtp", speculative_tokens=3, prefix_cache_images=8,
               **flags | (warm_flags or {}))  # fmt: skip
    cold_log, warm_log = DraftLog(cold), DraftLog(warm)
    for p, want in zip(prompts, serial, strict=True):  # one at a time: later ones resume from images
        same([want], cold.generate([p], params))
        same([want], warm.generate([p], params))
    assert sum(o.cached_tokens for o in warm.generate(prompts[1:], params)) > 0
    for p in prompts:
        assert cold_log.of(p) and warm_log.of(p)[: len(cold_log.of(p))] == cold_log.of(p)
    warm.engine.clear_prefix_cache()
    return cold, warm


TARGET_STATE = ("gdn_conv", "gdn_rec", "ple_ctx", "ple_conv")


def target_state(eng: LLMEngine, slot: int) -> dict[str, torch.Tensor]:
    """The slot's state that verify windows keep and rewind (all but the MTP layer's)."""
    s = eng.slots
    out = {name: getattr(s, name)[:, slot].clone() for name in TARGET_STATE}
    out["index_tail"] = s.index_tail[: s.index_tail.shape[0] - s.mtp_hidden.shape[0], slot].clone()
    return out


def check_window_batch(model_dir, flags: dict, k: int = 5, graph: bool = False) -> None:
    """Verify windows of three sequences in one forward (ModelRunner._verify: W = k rows, two windows
    shorter, so padded; `graph`: a CUDA graph replays it): every row up to a sequence's first wrong draft
    gives serial decode's logits bit for bit, and each slot is left with the state serial decode has after
    the committed rows, whether its window was rewound (a wrong draft) or not."""
    from nextserve.engine.scheduler import Chunk

    prompts = spec_prompts()
    params = SamplingParams(max_tokens=k + 8, temperature=0.0, ignore_eos=True)
    serial = LLMEngine(
        EngineConfig(model=str(model_dir), **flags, async_scheduling=False)
    )  # decode_logits hooked
    logits, states = {}, {}  # request id -> per decode step: logits [V], target state after it
    decode = serial.runner.decode_logits

    def record(chunks):
        out = decode(chunks)
        for i, ch in enumerate(chunks):
            logits.setdefault(ch.seq.request_id, []).append(out[0][i].clone())
            states.setdefault(ch.seq.request_id, []).append(target_state(serial, ch.seq.cache.slot))
        return out

    serial.runner.decode_logits = record
    rids = [serial.add_request(p, params) for p in prompts]
    tokens = {}
    while serial.has_unfinished():
        tokens |= {o.request_id: o.token_ids for o in serial.step() if o.finished}
    flags = flags | {"speculative_method": "ngram", "speculative_tokens": k}
    eng = LLMEngine(EngineConfig(model=str(model_dir), **flags))
    proposer, eng.scheduler.proposer = eng.scheduler.proposer, None  # plain decode until all have a token
    seqs = [eng.sequences[eng.add_request(p, params)] for p in prompts]
    while not all(s.output_ids for s in seqs):
        eng.step()
    eng.scheduler.proposer = proposer
    # rows per window and the index of its first wrong draft (None: all right)
    shapes = [(k, 2), (3, None), (2, 0)]
    chunks, done = [], []  # done: decode steps each sequence ran before its window
    for seq, rid, (n, wrong) in zip(seqs, rids, shapes, strict=True):
        d = len(seq.output_ids) - 1
        drafts = list(tokens[rid][d + 1 : d + n])
        if wrong is not None:
            drafts[wrong] = (drafts[wrong] + 1) % 256
        chunks.append(Chunk(seq, seq.num_computed, seq.num_computed + n, sample=True, drafts=tuple(drafts)))
        done.append(d)
    windows = []
    run = eng.runner.run_window
    eng.runner.run_window = lambda *a: windows.append(run(*a)) or windows[-1]
    results = eng.runner.execute_verifies(chunks)
    window_logits = windows[0][1]
    assert (windows[0][2] is not None) == graph  # a graph replay computes the argmax, eager does not
    for b, (rid, (n, wrong), r, d) in enumerate(zip(rids, shapes, results, done, strict=True)):
        assert r.error is None, r.error
        n_kept = n if wrong is None else wrong + 1
        assert r.computed == chunks[b].start + n_kept
        assert [r.token] + [t for t, _ in r.more] == tokens[rid][d + 1 : d + 1 + n_kept]
        bad = [j for j in range(n_kept) if not torch.equal(window_logits[j, b], logits[rid][d + j])]
        assert not bad, f"sequence {b}: window rows {bad} differ from serial decode"
        want = states[rid][d + n_kept - 1]
        got = target_state(eng, chunks[b].seq.cache.slot)
        bad = [name for name in want if not torch.equal(want[name], got[name])]
        assert not bad, f"sequence {b}: {bad} differ from serial decode's after {n_kept} rows"
