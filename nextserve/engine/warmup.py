"""Warm-up at start: every kernel specialisation a request can meet is compiled before the server says it
is ready, so no user pays a first-use compile (a rewritten agent turn paid 1.6 s on an H200: its last
prefill chunk was the first whose length was not a multiple of 16).

# NOTE: Triton compiles a kernel once per specialisation of its integer arguments (== 1, a multiple of 16,
# other), and the prefill kernels take the chunk's token count. Decode steps and verify windows are CUDA
# graphs captured before this (all their shapes compiled then). So the warm-up prefills chunks of
# prefill_chunk tokens, of 1 and of 17 tokens (and 32: a multiple of 16 that is not the chunk), and the
# same two kinds again past FLA_MIN_TOKENS (16-bit GDN chunks that long run fla's chunked kernels,
# ops/gdn.py, autotuned at their first call: here), where the chunk is longer, cold and,
# with prefix reuse on, resumed from an image; each decodes two tokens. The routed experts' prefill
# kernel also takes a BLOCK_M from the chunk's length (ops/moe.py default_block_m: at Flash-Next's
# widths 16 up to 409 tokens, 32 up to 1,228, 64, and 128 from 3,277), so each class of
# lengths it meets below the chunk gets its two kinds too (`tail_lengths`), as does each class of fla's
# autotuned L2 norm (ops/gdn.py fla_tune_class: each 4,096 tokens past the first at 16 key heads; the
# warm-up without it left a first 8,192-token prompt at --prefill-chunk 16384 to tune it, at 1,446 tok/s
# on an H100, BENCHMARKS.md, Prefix reuse and agent sessions). With --prefill-batch-chunks, two one-chunk
# prompts run together once (a forward of several chunks: the grouped experts over more rows; no kernel
# takes their row count as a specialised argument, but the path runs before serving all the same).
# Then it drops its images and counters: the engine starts as if nothing ran.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from ..model.gated_deltanet import GatedDeltaNet
from ..model.moe import SparseMoe
from ..ops.gdn import FLA_MIN_TOKENS, fla_tune_class
from ..ops.moe import default_block_m
from .sampling import SamplingParams

log = logging.getLogger("nextserve.engine")

# prefill chunk lengths past a full chunk: 1, other, a multiple of 16; twice more past FLA_MIN_TOKENS
TAILS = (1, 17, 32, FLA_MIN_TOKENS + 17, FLA_MIN_TOKENS + 32)


def use_compile_cache(path: str) -> None:
    """Keep Triton's compiled kernels in `path` (--compile-cache-dir), created if missing; set before any
    kernel compiles, and inherited by pipeline stage processes."""
    Path(path).mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(Path(path).resolve())


def tail_lengths(
    chunk: int, block_m_of: Callable[[int], int] | None = None, gdn_key_heads: int = 0
) -> list[int]:
    """The warm-up's chunk lengths below `chunk`: TAILS, then for each class of lengths that compiles
    another binary (the routed experts' BLOCK_M, `block_m_of(n)`; on which side of FLA_MIN_TOKENS and
    fla's autotune class at `gdn_key_heads`, `fla_tune_class`; a multiple of 16 or not) that TAILS miss,
    its shortest length."""
    tails = [n for n in TAILS if n < chunk]
    if block_m_of is None and not gdn_key_heads:
        return tails

    def kind(n: int) -> tuple:
        block_m = block_m_of(n) if block_m_of is not None else 0
        return block_m, n >= FLA_MIN_TOKENS, fla_tune_class(n, gdn_key_heads), n % 16 == 0

    covered = {kind(n) for n in tails if n > 1}
    for n in range(2, chunk):
        if kind(n) not in covered:
            covered.add(kind(n))
            tails.append(n)
    return sorted(tails)


def moe_block_m(model) -> Callable[[int], int] | None:
    """The routed experts' prefill BLOCK_M for a chunk of n tokens of `model` (None without MoE layers)."""
    moe = next((m for m in model.modules() if isinstance(m, SparseMoe)), None)
    if moe is None:
        return None
    E = moe.experts.gate_up.shape[0]
    return lambda n: default_block_m(n * moe.top_k, E)


def gdn_key_heads(model) -> int:
    """The key heads of `model`'s GDN layers (0 without them): fla's autotune classes depend on them."""
    gdn = next((m for m in model.modules() if isinstance(m, GatedDeltaNet)), None)
    return 0 if gdn is None else gdn.hk


def warm_up(engine) -> float:
    """Run the warm-up requests on `engine` (an LLMEngine); returns the seconds it took."""
    t0 = time.perf_counter()
    chunk = min(engine.config.prefill_chunk, max(1, engine.max_context - 32 - 4))
    tails = tail_lengths(chunk, moe_block_m(engine.model), gdn_key_heads(engine.model))
    tails = [n for n in tails if chunk + n + 4 <= engine.max_context] or [1]
    vocab = engine.model_config.vocab_size
    base = [10 + (i * 7919) % max(1, vocab - 10) for i in range(chunk)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = [base + base[:n] for n in tails]  # the second resumes from the first's image at `chunk`
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"nextserve-warm-up-{i}")
        while engine.has_unfinished():
            engine.step()
    config = engine.config
    if config.prefill_forward_chunks() > 1 and config.max_concurrency > 1 and chunk + 4 <= engine.max_context:
        # two one-chunk prompts at once (rotations of base: no image of base is their prefix), so a forward
        # of several chunks runs (their routed experts in one call)
        for i in (1, 2):
            engine.add_request(base[i:] + base[:i], params, request_id=f"nextserve-warm-up-together-{i}")
        while engine.has_unfinished():
            engine.step()
    engine.clear_prefix_cache()
    engine.reset_counters()
    seconds = time.perf_counter() - t0
    log.info("warm-up: %d requests (prefill chunks of %d, %s tokens) in %.2f s", len(prompts), chunk,
             "/".join(map(str, tails)), seconds)  # fmt: skip
    return seconds
