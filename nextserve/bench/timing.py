"""Timings of the benchmarks/ scripts: kernels (CUDA; eager median, and replayed from a CUDA graph), and cold
TTFT under modes that take turns."""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch


def kernel_us(fn) -> float:
    """Median µs of fn by triton.testing.do_bench."""
    import triton.testing

    return triton.testing.do_bench(fn, return_mode="median") * 1e3


def graph_us(fn) -> float:
    """Median µs of one replay of a CUDA graph of fn (compiled and warmed up outside the capture)."""
    fn()  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return kernel_us(graph.replay)


def ttft_by_mode(engine, modes: dict, lengths: list[int], rounds: int, seed: int) -> list[dict]:
    """Cold TTFT of prompts of each length under each mode (name -> a function that switches the engine's
    process to it), the modes taking turns on the same prompt in every round; round 0 warms every (mode,
    length) path and is not counted. Returns per (mode, length) the median TTFT (s) and its tok/s; the
    engine must not resume a prompt from a prefix image (prefix_cache=False)."""
    from ..engine.sampling import SamplingParams
    from .meters import sync

    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(seed)
    top = min(9000, engine.model_config.vocab_size)  # ids below 9,000, as the recorded GPU runs drew
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds + 1):
        for n in lengths:
            prompt = [rng.randrange(10, top) for _ in range(n)]
            for mode, switch in modes.items():
                switch()
                sync(engine.device)
                t = time.perf_counter()
                engine.add_request(prompt, first)
                while engine.has_unfinished():
                    engine.step()
                sync(engine.device)
                if r:
                    times.setdefault((mode, n), []).append(time.perf_counter() - t)
                    print(mode, n, round(times[mode, n][-1], 5), file=sys.stderr, flush=True)
    rows = []
    for (mode, n), ts in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        med = statistics.median(ts)
        rows.append({"mode": mode, "prompt_tokens": n, "ttft_s": round(med, 5), "tok_s": round(n / med, 1)})
    return rows
