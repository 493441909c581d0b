"""Where a long cold prefill spends its time on the GPU: op families (self time per module kind, synced at
module boundaries) and kernels summed by name, for each --prefill-chunk, random 8-layer flash-next weights.

    python benchmarks/profile_prefill.py --length 62700 --chunks 1024 8192 [--fp8]

Prints one JSON object (revision, hardware, command, one profile per chunk size).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nextserve.bench.model import bench_config, engine_for_model, random_flash_next  # noqa: E402
from nextserve.bench.profile import profile_prefill  # noqa: E402
from nextserve.bench.provenance import git_info, hardware  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--length", type=int, default=62700)
    p.add_argument("--chunks", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--fp8", action="store_true", help="block-wise FP8 projections and experts")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--revision", default=None, help="git revision to record when the tree has no .git")
    args = p.parse_args()
    device = torch.device("cuda")
    cfg, _ = bench_config("flash-next", args.layers)
    model = random_flash_next(cfg, device, torch.bfloat16, seed=0, fp8=args.fp8)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, cfg.vocab_size, (args.length,), generator=gen).tolist()
    out = {"git": git_info(args.revision), "hardware": hardware(device), "runs": []}
    out["command"] = " ".join(["python", *sys.argv])
    for chunk in args.chunks:
        engine = engine_for_model(
            model, device, torch.bfloat16, max_concurrency=1, max_context=args.length + 64,
            prefill_chunk=chunk, prefix_cache=False, warm_up=False,  # its own warm-up prefill
        )  # fmt: skip
        out["runs"].append({"prefill_chunk": chunk} | profile_prefill(engine, prompt, args.top))
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
