"""Warm-up at start: every kernel specialisation a request can meet is compiled before the server says it
is ready, so no user pays a first-use compile (a rewritten agent turn paid 1.6 s on an H200: its last
prefill chunk was the first whose length was not a multiple of 16).

# NOTE: Triton compiles a kernel once per specialisation of its integer arguments (== 1, a multiple of 16,
# other), and the prefill kernels take the chunk's token count. Decode steps and verify windows are CUDA
# graphs captured before this (all their shapes compiled then). So the warm-up prefills chunks of
# prefill_chunk tokens, of 1 and of 17 tokens (and 32: a multiple of 16 that is not the chunk), and the
# same two kinds again past FLA_MIN_TOKENS (16-bit GDN chunks that long run fla's chunked kernels,
# ops/gdn.py, autotuned at their first call: here), where the chunk is longer, cold and,
# with prefix reuse on, resumed from an image; each decodes two tokens. Then it drops its images and
# counters: the engine starts as if nothing ran.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from ..ops.gdn import FLA_MIN_TOKENS
from .sampling import SamplingParams

log = logging.getLogger("nextserve.engine")

# prefill chunk lengths past a full chunk: 1, other, a multiple of 16; twice more past FLA_MIN_TOKENS
TAILS = (1, 17, 32, FLA_MIN_TOKENS + 17, FLA_MIN_TOKENS + 32)


def use_compile_cache(path: str) -> None:
    """Keep Triton's compiled kernels in `path` (--compile-cache-dir), created if missing; set before any
    kernel compiles, and inherited by pipeline stage processes."""
    Path(path).mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(Path(path).resolve())


def warm_up(engine) -> float:
    """Run the warm-up requests on `engine` (an LLMEngine); returns the seconds it took."""
    t0 = time.perf_counter()
    chunk = min(engine.config.prefill_chunk, max(1, engine.max_context - 32 - 4))
    tails = [n for n in TAILS if n < chunk and chunk + n + 4 <= engine.max_context] or [1]
    vocab = engine.model_config.vocab_size
    base = [10 + (i * 7919) % max(1, vocab - 10) for i in range(chunk)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = [base + base[:n] for n in tails]  # the second resumes from the first's image at `chunk`
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"nextserve-warm-up-{i}")
        while engine.has_unfinished():
            engine.step()
    engine.clear_prefix_cache()
    engine.reset_counters()
    seconds = time.perf_counter() - t0
    log.info("warm-up: %d requests (prefill chunks of %d, %s tokens) in %.2f s", len(prompts), chunk,
             "/".join(map(str, tails)), seconds)  # fmt: skip
    return seconds
