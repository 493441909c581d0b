"""Speculative decoding against plain decoding, side by side: one prompt, greedy tokens, on engines with
--speculative-method off, then mtp (or ngram) at each draft width, run in alternating rounds
(off, K=1, K=2, ... off, K=1, ...) so a shared or throttled machine hits every mode alike. Tokens are
checked equal to off's (C1).

    python benchmarks/bench_speculative.py                       # default model, CPU, mtp K = 1..4
    python benchmarks/bench_speculative.py --stages 2 --device cuda --dtype bfloat16 \
        --pipeline-devices 0,0 --stage-transport host --widths 3  # also each mode through two stages
    ... --stages 2 --pipeline-windows  # and each mtp mode through the stages with --pipeline-windows

Prints one JSON object: revision, hardware, command, settings, and per mode the wall seconds of each
round (prefill + decode of one request), their median, tokens/s at the median, the ratio to off, the
drafts proposed and accepted, and with pipeline windows the guessed windows held and dropped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nextserve import LLM, SamplingParams  # noqa: E402
from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.engine_config import DEFAULT_MODEL  # noqa: E402

PROMPT = '''import os
import sys


def read_lines(path):
    """Return the lines of the file at path."""
    with open(path) as f:
        return f.read().splitlines()


def main(argv):
    for name in argv[1:]:
'''


def _rounds(
    a, modes: dict, prompt: str, params: SamplingParams, walls: dict, spec: dict, tokens: dict
) -> None:
    """a.rounds rounds, every mode once a round (one request each): walls, drafts and tokens recorded."""
    for _ in range(a.rounds):
        for name, llm in modes.items():
            before = llm.stats()
            t0 = time.perf_counter()
            (out,) = llm.generate([prompt], params)
            walls[name].append(round(time.perf_counter() - t0, 4))
            s = llm.stats()
            keys = ("spec_draft_tokens", "spec_accepted_tokens", "pipeline_windows_held")
            spec[name].append(tuple(s[k] - before[k] for k in (*keys, "pipeline_windows_dropped")))
            tokens.setdefault(name, out.token_ids)
            assert out.token_ids == tokens[name], f"{name}: tokens changed between rounds"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--method", default="mtp", choices=["mtp", "ngram"])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4], help="--speculative-tokens values")
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-file", default=None, help="a text file to use as the prompt instead")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--revision", default=None, help="record this git revision (a tree copied without .git)")
    ap.add_argument("--stages", type=int, default=1, help="> 1: every mode also through this many stages")
    ap.add_argument("--pipeline-devices", default=None)
    ap.add_argument("--stage-transport", default="auto")
    ap.add_argument("--head-embedding", default="device", help="the stages' MTP embeddings: device or host")
    ap.add_argument("--pipeline-windows", action="store_true", help="and mtp with windows")
    ap.add_argument("--no-cuda-graph", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    prompt = Path(a.prompt_file).read_text() if a.prompt_file else PROMPT
    flags = dict(
        device=a.device, dtype=a.dtype, prefill_chunk=a.prefill_chunk, kv_capacity=4096, max_concurrency=1,
        cuda_graph=not a.no_cuda_graph,
    )  # fmt: skip
    stage_flags = dict(
        pipeline_stages=a.stages, pipeline_devices=a.pipeline_devices, stage_transport=a.stage_transport
    )
    specs = {"off": {}} | {f"{a.method}-k{k}": dict(speculative_method=a.method, speculative_tokens=k)
                           for k in a.widths}  # fmt: skip
    modes = {name: LLM(a.model, **flags, **spec) for name, spec in specs.items()}
    if a.stages > 1:
        for name, spec in specs.items():
            heads = {"head_embedding": a.head_embedding} if spec.get("speculative_method") == "mtp" else {}
            modes[f"{a.stages} stages, {name}"] = LLM(a.model, **flags, **spec, **stage_flags, **heads)
            if a.pipeline_windows and heads:
                modes[f"{a.stages} stages, {name} + windows"] = LLM(
                    a.model, **flags, **spec, **stage_flags, **heads, pipeline_windows=True
                )
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    for llm in modes.values():  # warm-up (allocations, kernels)
        llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    walls: dict[str, list[float]] = {m: [] for m in modes}
    spec: dict[str, list[tuple[int, ...]]] = {m: [] for m in modes}
    tokens: dict[str, list[int]] = {}
    try:
        _rounds(a, modes, prompt, params, walls, spec, tokens)
    finally:
        for llm in modes.values():
            llm.close()
    off_median = statistics.median(walls["off"])
    figures = {}
    for name in modes:
        median = statistics.median(walls[name])
        drafted, accepted, held, dropped = spec[name][0]
        same_stages_off = name.rsplit(", ", 1)[0] + ", off" if ", " in name else "off"
        figures[name] = {
            "wall_s": walls[name],
            "median_wall_s": median,
            "tokens_per_s": round(a.tokens / median, 2),
            "speedup_vs_off": round(off_median / median, 3),
            "drafted": drafted,
            "accepted": accepted,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "tokens_equal_off": tokens[name] == tokens["off"],
            "speedup_vs_same_stages_off": round(statistics.median(walls[same_stages_off]) / median, 3),
        }
        if held or dropped:
            figures[name] |= {"windows_held": held, "windows_dropped": dropped}
    print(
        json.dumps(
            {
                "benchmark": "bench_speculative",
                "git": git_info(a.revision),
                "hardware": hardware(a.device),
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "settings": vars(a) | {"prompt_chars": len(prompt)},
                "note": "wall time covers prefill + decode of one request; rounds alternate the modes",
                "modes": figures,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
