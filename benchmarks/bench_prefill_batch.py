"""--prefill-batch-chunks side by side: engines over one random 8-layer flash-next model (bf16, or block-wise
FP8 with --fp8), one per value, taking turns in each round on the same prompts (prefix reuse off: every
prompt cold). Workloads: one cold 62,700-token prompt (TTFT), four 16K prompts submitted at once (time until
all four have their first token, and their mean TTFT), sixteen 1K prompts at once (prefill tok/s). The first
tokens of every engine must agree (the flag changes no output). Prints JSON; run on a CUDA machine:

    python benchmarks/bench_prefill_batch.py [--batch 1 4] [--rounds 3] [--fp8]
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

from nextserve.bench.model import bench_config, engine_for_model, random_flash_next  # noqa: E402
from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.engine.sampling import SamplingParams  # noqa: E402

FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _run(engine, prompts: list[list[int]]) -> tuple[float, list[float], list[int]]:
    """Submit `prompts` at once and step until each has its first token: (wall s, TTFT s each, tokens)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    rids = [engine.add_request(p, FIRST) for p in prompts]
    seqs = [engine.sequences[r] for r in rids]
    ttft: dict[int, float] = {}
    while len(ttft) < len(seqs):
        engine.step()
        for i, s in enumerate(seqs):
            if i not in ttft and s.output_ids:
                ttft[i] = time.perf_counter() - t0
    tokens = [s.output_ids[0] for s in seqs]
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, [ttft[i] for i in range(len(seqs))], tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    device = torch.device("cuda")
    cfg, _ = bench_config("flash-next", args.layers)
    model = random_flash_next(cfg, device, torch.bfloat16, seed=0, fp8=args.fp8)
    gen = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    work = {"cold_62700": [rand(62700)], "four_16k": [rand(16384) for _ in range(4)],
            "sixteen_1k": [rand(1024) for _ in range(16)]}  # fmt: skip
    engines = {
        b: engine_for_model(
            model,
            device,
            torch.bfloat16,
            max_concurrency=16,
            max_context=62700 + 64,
            kv_capacity=140_000,
            prefill_chunk=args.chunk,
            prefill_batch_chunks=b,
            prefix_cache=False,
        )  # fmt: skip
        for b in args.batch
    }
    for eng in engines.values():  # a warm-up of every workload (the engines warmed up at start too)
        for prompts in work.values():
            _run(eng, prompts)
    times: dict = {b: {w: [] for w in work} for b in args.batch}
    firsts: dict = {b: {} for b in args.batch}
    for _ in range(args.rounds):
        for name, prompts in work.items():
            for b, eng in engines.items():
                wall, ttft, tokens = _run(eng, prompts)
                times[b][name].append((wall, statistics.mean(ttft)))
                firsts[b][name] = tokens
    rows = {}
    for b in args.batch:
        row = {}
        for name, prompts in work.items():
            walls = [w for w, _ in times[b][name]]
            wall = statistics.median(walls)
            row[name] = {"wall_s_median": round(wall, 4), "walls_s": [round(w, 4) for w in walls],
                         "mean_ttft_s_median": round(statistics.median(t for _, t in times[b][name]), 4),
                         "prefill_tok_s": round(sum(map(len, prompts)) / wall)}  # fmt: skip
        rows[f"prefill_batch_chunks={b}"] = row
    base = args.batch[0]
    same = all(firsts[b] == firsts[base] for b in args.batch)
    wall = lambda b, n: statistics.median(w for w, _ in times[b][n])  # noqa: E731
    ratios = {f"{b}_vs_{base}": {n: round(wall(base, n) / wall(b, n), 3) for n in work}
              for b in args.batch if b != base}  # fmt: skip
    out = {"benchmark": "prefill_batch", "git": git_info(None), "hardware": hardware(device),
           "command": " ".join(["python", *sys.argv]), "weights": "fp8" if args.fp8 else "bf16",
           "layers": args.layers, "prefill_chunk": args.chunk, "first_tokens_equal": same,
           "rows": rows, "speedup": ratios}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
