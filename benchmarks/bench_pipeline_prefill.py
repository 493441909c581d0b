"""One long prompt's cold prefill through pipeline stages: the stages taking turns
(--pipeline-prefill-chunks 1: a chunk enters stage 0 once the one before has left the last stage) against
chunks in flight (auto: one per stage; or any --chunks values), in alternating rounds; first tokens
checked equal to one process's (C1).

    python benchmarks/bench_pipeline_prefill.py                      # default model, CPU, 2 stages
    python benchmarks/bench_pipeline_prefill.py --model /tmp/ref8 --device cuda --dtype bfloat16 \\
        --pipeline-devices 0,0 --stage-transport host --length 62700  # two stages on one GPU

Prints one JSON object: revision, hardware, command, settings, and per mode the TTFT of each round, their
median, and prefill tokens/s at the median.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_pipeline import stage_arguments  # noqa: E402

from nextserve import LLM, SamplingParams  # noqa: E402
from nextserve.bench.provenance import git_info, hardware  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stage_arguments(ap)
    ap.add_argument("--length", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument(
        "--chunks",
        nargs="+",
        default=["1", "auto"],
        help="--pipeline-prefill-chunks values to compare (the first is the baseline)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 2000, (a.length,), generator=g).tolist()
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    # NOTE: a pool for the one prompt (auto would give each engine all the free memory), no prefix reuse
    # (every round is cold)
    flags = dict(device=a.device, dtype=a.dtype, max_concurrency=1, prefill_chunk=a.prefill_chunk,
                 kv_capacity=a.length + 1024, max_context=a.length + 1024, prefix_cache=False)  # fmt: skip
    one = LLM(a.model, **flags)
    want = one.generate([prompt], params)[0].token_ids
    one.close()
    del one
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engines = {
        f"{a.stages} stages, --pipeline-prefill-chunks {chunks}, {transport}": LLM(
            a.model,
            pipeline_stages=a.stages,
            pipeline_devices=a.pipeline_devices,
            stage_transport=transport,
            pipeline_prefill_chunks=chunks if chunks == "auto" else int(chunks),
            **flags,
        )  # fmt: skip
        for transport in a.stage_transport
        for chunks in a.chunks
    }
    walls: dict[str, list[float]] = {name: [] for name in engines}
    same = dict.fromkeys(engines, True)
    try:
        for name, llm in engines.items():  # a first run of each (kernels compiled, buffers allocated)
            same[name] = llm.generate([prompt], params)[0].token_ids == want
        for _ in range(a.rounds):
            for name, llm in engines.items():
                t0 = time.perf_counter()
                out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
                walls[name].append(round(time.perf_counter() - t0, 4))
                same[name] = same[name] and out[0].token_ids == want[:1]
    finally:
        for llm in engines.values():
            llm.close()
    modes = {}
    for name, w in walls.items():
        med = statistics.median(w)
        modes[name] = {"ttft_s": w, "median_ttft_s": med, "prefill_tokens_per_s": round(a.length / med, 1),
                       "tokens_equal_one_process": same[name]}  # fmt: skip
    base = modes[next(iter(engines))]["median_ttft_s"]
    for m in modes.values():
        m["speedup_over_first"] = round(base / m["median_ttft_s"], 3)
    out = {"benchmark": "bench_pipeline_prefill", "git": git_info(a.revision), "hardware": hardware(a.device),
           "command": " ".join(["python", *sys.argv]), "settings": vars(a), "modes": modes}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
