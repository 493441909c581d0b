"""Pipeline stages side by side: one process, then N stages with --decode-groups 1, 2, ... on the same
model and requests (greedy, several requests decoding together), in alternating rounds so a shared or
throttled machine hits every mode alike. Tokens are checked equal to one process's (C1).

    python benchmarks/bench_pipeline.py                          # default model, CPU, 2 stages, 1 thread
    python benchmarks/bench_pipeline.py --device cuda --dtype bfloat16 --pipeline-devices 0,1
    python benchmarks/bench_pipeline.py --requests 1 --groups 1 --trace /tmp/trace  # where a token goes

Prints one JSON object: revision, hardware, command, settings, and per mode the wall seconds of each round
(prefill + decode of every request), their median and output tokens/s at the median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nextserve import LLM, SamplingParams  # noqa: E402
from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.engine_config import DEFAULT_MODEL  # noqa: E402
from nextserve.runtime.stage_worker import TRACE_ENV  # noqa: E402


def stage_arguments(ap: argparse.ArgumentParser) -> None:
    """The model, device and stage flags the pipeline benchmarks share."""
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--pipeline-devices", default=None)
    ap.add_argument(
        "--stage-transport", nargs="+", default=["auto"], help="one or more: each is measured side by side"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (every stage runs the driver's)")
    ap.add_argument("--revision", default=None, help="record this git revision (a tree copied without .git)")


def _trace_dir(root: str, mode: str) -> Path:
    path = Path(root) / mode.replace(", ", "_").replace(" ", "-")
    path.mkdir(parents=True, exist_ok=True)
    return path


def decode_item_times(trace: Path, stages: int) -> list[dict[str, float]]:
    """Per stage, the medians (µs) of its decode items' wait for their input, compute (to the GPU's end) and
    send (status and streams on), from its trace (stage_worker._trace)."""
    out = []
    for r in range(stages):
        items = [json.loads(line) for line in (trace / f"stage-{r}.jsonl").read_text().splitlines()]
        items = [i for i in items if i["kind"] == "decode"]
        parts = {"wait": ("waited", "start"), "compute": ("start", "end"), "send": ("end", "sent")}
        out.append({"items": len(items)} | {
            p: round(statistics.median(i[b] - i[a] for i in items) * 1e6, 1) for p, (a, b) in parts.items()
        })  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stage_arguments(ap)
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 2], help="--decode-groups values")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--eager-too", action="store_true", help="also each stage mode with --no-cuda-graph (GPU)"
    )
    ap.add_argument(
        "--trace", default=None,
        help="a directory: each stage mode's stages record their items' times there (stage_worker's "
        "TRACE_ENV), and each mode gets the medians a decode item spent waiting, computing and sending",
    )  # fmt: skip
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 2000, (32 + 8 * i,), generator=g).tolist() for i in range(a.requests)]
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    # NOTE: a pool for these requests: auto gives each engine the memory left, and the engines here share
    # one device (the one process first would leave the stages none)
    longest = max(len(p) for p in prompts) + a.tokens
    flags = dict(device=a.device, dtype=a.dtype, max_concurrency=a.requests,
                 kv_capacity=a.requests * longest + 1024, max_context=longest + 64)  # fmt: skip
    engines = {"one process": LLM(a.model, **flags)}
    for transport in a.stage_transport:
        for groups in a.groups:
            for graph in (True, False) if a.eager_too else (True,):
                name = f"{a.stages} stages, {groups} groups, {transport}" + ("" if graph else ", eager")
                if a.trace is not None:  # (read as each stage starts)
                    os.environ[TRACE_ENV] = str(_trace_dir(a.trace, name))
                engines[name] = LLM(
                    a.model, pipeline_stages=a.stages, decode_groups=groups, stage_transport=transport,
                    pipeline_devices=a.pipeline_devices, cuda_graph=graph, **flags,
                )  # fmt: skip
    want = [o.token_ids for o in engines["one process"].generate(prompts, params)]
    walls: dict[str, list[float]] = {name: [] for name in engines}
    same = {}
    try:
        for _ in range(a.rounds):
            for name, llm in engines.items():
                t0 = time.perf_counter()
                out = llm.generate(prompts, params)
                walls[name].append(round(time.perf_counter() - t0, 4))
                same[name] = same.get(name, True) and [o.token_ids for o in out] == want
    finally:
        for llm in engines.values():
            llm.close()
    modes = {}
    base = statistics.median(walls["one process"])
    for name, w in walls.items():
        med = statistics.median(w)
        tps = round(a.requests * a.tokens / med, 2)
        modes[name] = {"wall_s": w, "median_wall_s": med, "tokens_per_s": tps,
                       "tokens_equal_one_process": same[name]}  # fmt: skip
        if name != "one process":
            # NOTE: a token crosses every stage boundary once and comes back to stage 0 once (its logits):
            # `stages` hops. What the stages add to a round, spread over its decode steps' hops, is the
            # hop's cost when the stages' own work is the one process's (one request: nothing overlaps).
            hops = a.stages * a.tokens
            modes[name]["extra_us_per_hop"] = round((med - base) / hops * 1e6, 1)
            if a.trace is not None:
                by_stage = decode_item_times(_trace_dir(a.trace, name), a.stages)
                modes[name]["decode_item_us_by_stage"] = by_stage
    out = {"benchmark": "bench_pipeline", "git": git_info(a.revision), "hardware": hardware(a.device),
           "command": " ".join(["python", *sys.argv]), "settings": vars(a), "modes": modes}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
