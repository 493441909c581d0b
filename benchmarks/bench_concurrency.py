"""N concurrent requests against the same N one at a time, on a tiny random model (issue 3).

Prints one JSON object: the git revision, the hardware, the command line, the settings, and for each
mode the wall time and tokens/s, plus the ratio concurrent / one-at-a-time. Greedy decoding with
ignore_eos, so both modes do the same work, and the outputs of the two modes are compared (C1).

    python benchmarks/bench_concurrency.py                  # tiny preset, CPU
    python benchmarks/bench_concurrency.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from nextserve import LLM, SamplingParams
from nextserve.bench import git_info, hardware


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, one_at_a_time: bool) -> dict:
    sync = torch.cuda.synchronize if llm.engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    if one_at_a_time:
        outs = [llm.generate([p], params)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params)
    sync()
    wall = time.perf_counter() - t0
    gen = sum(len(o.token_ids) for o in outs)
    total = gen + sum(len(p) for p in prompts)
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"], stats
    return {
        "wall_s": round(wall, 4),
        "output_tokens": gen,
        "output_tokens_per_s": round(gen / wall, 2),
        "total_tokens_per_s": round(total / wall, 2),
        "outputs": [o.token_ids for o in outs],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: a fresh `make_model('tiny')`)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per mode; the best is reported")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from nextserve.model.make_model import make_model

            model = str(make_model("tiny", Path(tmp) / "tiny", seed=args.seed))
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(3, 500) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        budget = args.prompt_len + args.max_tokens
        flags = dict(
            dtype=args.dtype,
            device=args.device,
            page_size=args.page_size,
            prefill_chunk=args.prefill_chunk,
            max_context=budget,
            kv_capacity=budget * args.requests,
        )
        results = {}
        for name, conc, serial in (("one_at_a_time", 1, True), ("concurrent", args.requests, False)):
            llm = LLM(model, max_concurrency=conc, **flags)
            run(llm, prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), serial)  # warm up
            runs = [run(llm, prompts, params, serial) for _ in range(args.repeats)]
            results[name] = min(runs, key=lambda r: r["wall_s"])
            del llm

    same = results["concurrent"].pop("outputs") == results["one_at_a_time"].pop("outputs")
    report = {
        "benchmark": "concurrency",
        "git": git_info(),
        "hardware": hardware(args.device),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": vars(args) | {"model": args.model or "make_model('tiny')"},
        "one_at_a_time": results["one_at_a_time"],
        "concurrent": results["concurrent"],
        "ratio_output_tokens_per_s": round(
            results["concurrent"]["output_tokens_per_s"] / results["one_at_a_time"]["output_tokens_per_s"], 3
        ),
        "outputs_identical": same,
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
