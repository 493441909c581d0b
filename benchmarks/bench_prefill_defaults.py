"""Prefill of unique 1,024-token prompts under the prefix-cache defaults, side by side in one process:
prefix reuse on with the host image store (auto), on without it (--host-state-slots 0), and off
(--no-prefix-cache). Random 8-layer flash-next weights on the GPU; median of 8 after 2 warm-ups.

    python benchmarks/bench_prefill_defaults.py [--out FILE] [--prefill-chunk 512 --device-images 2]

A chunk below the prompt's length leaves a prefix image on its grid for every prompt; with few device
images each new one then spills an older one to the host store (when it is on) during the prefills.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nextserve.bench.model import bench_config, engine_for_model, random_flash_next  # noqa: E402
from nextserve.engine.sampling import SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--prefill-chunk", type=int, default=None, help="default: the engine's")
    p.add_argument("--device-images", type=int, default=None, help="--prefix-cache-images")
    args = p.parse_args()
    sizing = {"prefill_chunk": args.prefill_chunk, "prefix_cache_images": args.device_images}
    sizing = {k: v for k, v in sizing.items() if v is not None}
    cfg, _ = bench_config("flash-next", 8, None)
    model = random_flash_next(cfg, "cuda", torch.bfloat16, seed=0)
    rng = random.Random(5)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    res = {}
    modes = {"prefix_on_host_auto": {}, "prefix_on_host_off": {"host_state_slots": 0},
             "prefix_off": {"prefix_cache": False}}  # fmt: skip
    for name, flags in modes.items():
        flags = {"max_context": 8192} | sizing | flags
        engine = engine_for_model(model, torch.device("cuda"), torch.bfloat16, **flags)
        times = []
        for i in range(10):
            prompt = [rng.randrange(10, 9000) for _ in range(args.length)]
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine.add_request(prompt, params)
            while engine.has_unfinished():
                engine.step()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t)
        s = engine.stats()
        res[name] = {"tok_per_s": round(args.length / statistics.median(times), 1),
                     "host_images": s["host_images"], "prefix_images": s["prefix_images"],
                     "flags": flags}  # fmt: skip
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
