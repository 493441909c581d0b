"""Measure a trained model with nextserve's own inference code (FlashNext + MTP from loader.load_weights):
validation loss on held-out stdlib text, and MTP acceptance along the target's greedy continuation."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..model.batch import ForwardBatch, SeqChunk
from ..model.flash_next import FlashNext
from ..model.loader import load_weights
from ..model.mtp import MTP


def load(model_dir: Path, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, FlashNext, MTP]:
    cfg = ModelConfig.from_dir(model_dir)
    w = load_weights(Path(model_dir), cfg, with_mtp=True, dtype=dtype)
    model = FlashNext(cfg).to(dtype)
    model.load_state_dict({k: v for k, v in w.items() if not k.startswith("mtp.")}, strict=True)
    mtp = MTP(cfg).to(dtype)
    mtp.load_state_dict({k[4:]: v for k, v in w.items() if k.startswith("mtp.")}, strict=True)
    return cfg, model.eval(), mtp.eval()


def new_cache(cfg: ModelConfig, dtype: torch.dtype, tokens: int, page_size: int = 16, kv_dtype: str = "auto"):
    """One sequence's cache (main QSA layers + the MTP layer's planes) for `tokens` positions, its KV planes
    of `kv_dtype` (KVPool)."""
    from ..cache.kv_pool import KVPool
    from ..cache.sequence import SequenceCache
    from ..cache.states import StateSlots

    n_attn = len(cfg.qsa_layers) + 1
    pool = KVPool(cfg, n_attn, -(-tokens // page_size) + 1, page_size, dtype, kv_dtype=kv_dtype)
    seq = SequenceCache(pool, StateSlots(cfg, 1, n_attn, dtype))
    seq.reserve(tokens)
    return seq


@torch.no_grad()
def validation_loss(
    model: FlashNext, ids: list[int], window: int, windows: int, dtype=torch.float32, kv_dtype: str = "auto"
) -> dict:
    """Mean next-token cross-entropy over `windows` non-overlapping windows of held-out tokens, each
    prefilled from position 0 as one chunk (the serial reference with chunk >= window), the KV cache of
    `kv_dtype`."""
    total, n = 0.0, 0
    for w in range(windows):
        x = torch.tensor(ids[w * window : (w + 1) * window + 1])
        if x.numel() < window + 1:
            break
        cache = new_cache(model.cfg, dtype, window, kv_dtype=kv_dtype)
        batch = ForwardBatch(x[:-1], torch.arange(window), [SeqChunk(cache, 0, window)], False)
        logits = model.logits(model(batch), row_invariant=False)
        total += F.cross_entropy(logits.float(), x[1:]).item()
        n += 1
    return {"val_loss": total / max(n, 1), "windows": n, "window": window}


@torch.no_grad()
def greedy_with_drafts(
    model: FlashNext,
    mtp: MTP,
    prompt: list[int],
    new_tokens: int,
    k: int,
    chunk: int = 64,
    dtype=torch.float32,
) -> tuple[list[int], list[list[int]], float]:
    """The serial reference's greedy continuation of `prompt`, and at every generated position the MTP
    greedy chain of k drafts (as speculative decoding would propose it there).

    Returns (generated tokens g_1.., drafts per position: drafts[i] is the chain proposed after g_{i+1} is
    known (i.e. guesses for g_{i+2}..g_{i+k+1}), target seconds per token)."""
    cfg = model.cfg
    P = len(prompt)
    cache = new_cache(cfg, dtype, P + new_tokens + k + 1)
    ids = list(prompt)
    streams = []
    for s in range(0, P, chunk):
        e = min(s + chunk, P)
        batch = ForwardBatch(torch.tensor(ids[s:e]), torch.arange(s, e), [SeqChunk(cache, s, e - s)], False)
        streams.append(model(batch))
    x = torch.cat(streams)
    gen = [int(model.logits(x[-1:]).argmax(-1))]
    # MTP prefill over prompt rows 0..P-2 (row t: streams[t], token t+1), as the engine's draft prefill.
    nxt = torch.tensor(ids[1:])
    batch = ForwardBatch(nxt, torch.arange(P - 1), [SeqChunk(cache, 0, P - 1)], False)
    mtp(x[:-1], F.embedding(nxt, model.embed_tokens.weight), batch, model.rope(batch.positions, dtype))
    last = x[-1:]
    drafts = []
    t_target, target_steps = 0.0, 0
    for i in range(new_tokens):
        pos = P - 1 + i  # row whose streams are `last`; the token after it is gen[i]
        d, _ = mtp.draft(model, last, gen[i], pos, cache, k)
        drafts.append(d)
        ts = time.perf_counter()
        batch = ForwardBatch(
            torch.tensor([gen[i]]), torch.tensor([pos + 1]), [SeqChunk(cache, pos + 1, 1)], True
        )
        last = model(batch)
        gen.append(int(model.logits(last).argmax(-1)))
        t_target += time.perf_counter() - ts
        target_steps += 1
    return gen, drafts, t_target / max(target_steps, 1)


def acceptance(gen: list[int], drafts: list[list[int]], width: int) -> dict:
    """Per position i, drafts[i][:width] against the target's greedy tokens gen[i+1 : i+1+width]:
    accepted length = matching prefix. Positions whose window runs past the generation are skipped."""
    lengths, per_depth, n = [], [0] * width, 0
    for i, d in enumerate(drafts):
        truth = gen[i + 1 : i + 1 + width]
        if len(truth) < width:
            break
        a = 0
        while a < width and d[a] == truth[a]:
            a += 1
        lengths.append(a)
        for j in range(a):
            per_depth[j] += 1
        n += 1
    return {"width": width, "positions": n, "accepted_total": sum(lengths), "reached_depth": per_depth}


def summarize(results: list[dict]) -> dict:
    """Pool acceptance() results of one width: mean accepted length and, per depth j, the rate
    P(draft j accepted | drafts 1..j-1 accepted)."""
    n = sum(r["positions"] for r in results)
    width = results[0]["width"]
    reached = [sum(r["reached_depth"][j] for r in results) for j in range(width)]
    prev = [n] + reached[:-1]
    return {
        "positions": n,
        "mean_accepted": sum(r["accepted_total"] for r in results) / max(n, 1),
        "per_depth_conditional": [reached[j] / prev[j] if prev[j] else 0.0 for j in range(width)],
        "per_depth_absolute": [reached[j] / max(n, 1) for j in range(width)],
    }
