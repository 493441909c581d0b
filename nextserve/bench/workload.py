"""The nextserve workload: prefill and decode through the engine's scheduler and runner."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from .meters import EnergyMeter, Window, peak_memory, reset_peak, sync

FIRST_PROMPT_ID = 8
# Untimed decode steps at each concurrency before the timed ones: the first step at a new batch size pays
# one-off costs (on the H200 run of 2026-11-30, transformers' first c1 and c8 steps took 1.1 s against a
# median of 0.08 s).
WARM_DECODE_STEPS = 1


def random_prompt(rng: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(FIRST_PROMPT_ID, vocab, (n,), generator=rng).tolist()


def ns_prefill(engine, prompt: list[int], meter: EnergyMeter) -> dict[str, Any]:
    """One request of max_tokens 1: its chunked prefill and first token (TTFT = prefill time)."""
    from ..engine.sampling import SamplingParams

    device = engine.device
    reset_peak(device)
    token = None
    with Window(device, meter) as w:
        rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        steps = 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid and out.token_ids:
                    token = out.token_ids[0]
            steps += 1
    return {
        "prompt_len": len(prompt),
        "engine_steps": steps,
        "first_token": token,
        "ttft_s": round(w.seconds, 4),
        "prefill_tok_per_s": round(len(prompt) / w.seconds, 1),
        **w.energy(len(prompt)),
        "peak_memory_bytes": peak_memory(device),
    }


def decode_max_tokens(concurrency: int, prompt_len: int, prefill_chunk: int, steps: int) -> int:
    """max_tokens for a decode run: no request may finish before the last one has its first token (the
    scheduler runs one prefill chunk per step, so the first request decodes while the others prefill)."""
    return concurrency * -(-prompt_len // prefill_chunk) + WARM_DECODE_STEPS + steps + 2


def ns_decode(engine, prompts: list[list[int]], steps: int, meter: EnergyMeter) -> dict[str, Any]:
    """`len(prompts)` concurrent requests: prefill them all (the scheduler's own mix of prefill chunks and
    decodes), then time `steps` engine steps in which every request decodes one token; then abort them."""
    from ..engine.sampling import SamplingParams

    device = engine.device
    B = len(prompts)
    max_tokens = decode_max_tokens(B, len(prompts[0]), engine.config.prefill_chunk, steps)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reset_peak(device)
    sync(device)
    t_add = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    seqs = [engine.sequences[i] for i in ids]
    first: dict[str, float] = {}
    while len(first) < B:
        engine.step()
        now = time.perf_counter()
        for s in seqs:
            if s.output_ids and s.request_id not in first:
                first[s.request_id] = now - t_add
    for _ in range(WARM_DECODE_STEPS):
        engine.step()
    before = [len(s.output_ids) for s in seqs]
    step_s = []
    settle_expert_cache(engine)
    cache_before = engine.stats()
    with Window(device, meter) as w:
        # NOTE: no device sync per step: with async scheduling a step returns while the GPU runs the
        # next one (the window syncs at its ends); a step's wall time then ends when it has read the
        # previous step's tokens
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t0)
    settle_expert_cache(engine)
    cache_after = engine.stats()
    made = [len(s.output_ids) - b for s, b in zip(seqs, before, strict=True)]
    # Context of each request at the middle of the window (early ones decoded while others prefilled).
    mean_context = statistics.mean(
        len(s.prompt_ids) + b + steps / 2 for s, b in zip(seqs, before, strict=True)
    )
    if made != [steps] * B or any(s.finished for s in seqs):
        raise RuntimeError(f"decode steps did not advance every request once per step: {made}")
    for rid in ids:
        engine.abort(rid)
    engine.step()  # forgets the aborted requests
    stats = engine.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"], stats
    ttfts = sorted(first.values())
    tokens = B * steps
    return {
        "concurrency": B,
        "prompt_len": len(prompts[0]),
        "decode_steps": steps,
        "mean_context": round(mean_context, 1),
        "decode_tok_per_s": round(tokens / w.seconds, 2),
        "decode_tok_per_s_median_step": round(B / statistics.median(step_s), 2),
        "step_s_median": round(statistics.median(step_s), 5),
        "step_s_min": round(min(step_s), 5),
        "step_s_max": round(max(step_s), 5),
        "ttft_s_first": round(ttfts[0], 4),
        "ttft_s_last": round(ttfts[-1], 4),
        **w.energy(tokens),
        "peak_memory_bytes": peak_memory(device),
        "expert_cache": expert_cache_window(cache_before, cache_after, tokens),
    }


def settle_expert_cache(engine: Any) -> None:
    """Account an LLMEngine's expert cache's routing up to now (none: nothing), so a window counts its own
    steps."""
    if engine.expert_cache is not None:
        engine.expert_cache.settle()


def expert_cache_window(before: dict, after: dict, tokens: int) -> dict[str, Any] | None:
    """The device expert cache's counters over a timed window of `tokens` decoded tokens (engine stats taken
    at its ends, the cache settled there: the window's own routed pairs): hits, misses, fills, hit rate,
    link bytes a token. None without a cache."""
    if "expert_cache_hits" not in after:
        return None
    keys = [k for k in after if k.startswith("expert_cache_")]
    d = {k.removeprefix("expert_cache_"): after[k] - before.get(k, 0) for k in keys}
    d["slots"] = after["expert_cache_slots"]
    pairs = d["hits"] + d["misses"]
    d["hit_rate"] = round(d["hits"] / pairs, 4) if pairs else None
    d["link_bytes_per_token"] = round(d["link_bytes"] / tokens) if tokens else None
    return d
