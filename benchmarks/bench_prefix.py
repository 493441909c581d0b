"""An agent session with and without prefix reuse, side by side (DESIGN.md section 2).

Each turn resends the whole conversation (system prompt, earlier turns and replies) plus a new user
message, as agent clients do. Prints one JSON object: revision, hardware, command, settings, and per
mode the wall time, time to first token per turn, prompt tokens computed vs resumed; outputs compared.

    python benchmarks/bench_prefix.py                 # tiny preset, CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from nextserve import LLM, SamplingParams
from nextserve.bench import git_info, hardware
from nextserve.model.make_model import make_model


def session(llm: LLM, system: list[int], messages: list[list[int]], reply_tokens: int) -> dict:
    params = SamplingParams(max_tokens=reply_tokens, temperature=0.0, ignore_eos=True)
    eng, history, ttfts, cached, replies = llm.engine, list(system), [], [], []
    t_start = time.perf_counter()
    for msg in messages:
        prompt = history + msg
        t0 = time.perf_counter()
        rid = eng.add_request(prompt, params, checkpoints=(len(history),))
        first, done = None, None
        while done is None:
            for out in eng.step():
                if out.request_id == rid and out.token_ids and first is None:
                    first = time.perf_counter() - t0
                if out.request_id == rid and out.finished:
                    done = out
        ttfts.append(round(first, 4))
        cached.append(done.cached_tokens)
        replies.append(done.token_ids)
        history = prompt + done.token_ids
    return {
        "wall_s": round(time.perf_counter() - t_start, 3),
        "ttft_s": ttfts,
        "cached_tokens": cached,
        "replies": replies,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--message-tokens", type=int, default=40)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=64)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(args.preset, Path(tmp) / "m", seed=0)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        system = torch.randint(10, vocab, (args.system_tokens,), generator=g).tolist()
        messages = [
            torch.randint(10, vocab, (args.message_tokens,), generator=g).tolist() for _ in range(args.turns)
        ]
        flags = dict(device=args.device, dtype=args.dtype, prefill_chunk=args.prefill_chunk, page_size=16,
                     max_concurrency=2, kv_capacity=8192, max_context=4096)  # fmt: skip
        results = {}
        # NOTE: prefix reuse is on by default, so the cold engine turns it off
        for name, extra in (("cold", {"prefix_cache": False}), ("prefix_reuse", {"prefix_cache_images": 16})):
            results[name] = session(LLM(str(model), **flags, **extra), system, messages, args.reply_tokens)
    identical = results["cold"].pop("replies") == results["prefix_reuse"].pop("replies")
    print(json.dumps({
        "benchmark": "prefix_reuse",
        "git": git_info(),
        "hardware": hardware(args.device),
        "command": " ".join(["python", *sys.argv]),
        "settings": vars(args),
        **results,
        "ratio_wall_cold_over_reuse": round(results["cold"]["wall_s"] / results["prefix_reuse"]["wall_s"], 3),
        "ratio_mean_ttft_cold_over_reuse": round(
            sum(results["cold"]["ttft_s"]) / sum(results["prefix_reuse"]["ttft_s"]), 3),
        "outputs_identical": identical,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
