"""What the host image store costs a stream of distinct prompts: 1K-token prefills (each leaves an image; past
--prefix-cache-images the oldest go to the host store) with the store on (--host-state-slots 64) against off,
alternating, on one random model drawn on the device (8 layers at the flash-next widths, bf16).

    python benchmarks/bench_host_store_prefill.py [--prompts 16] [--rounds 3]

Prints one JSON object: per mode the median prefill tok/s of each round and the images it moved to the host.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nextserve.bench.model import bench_config, engine_for_model, random_flash_next  # noqa: E402
from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.engine.sampling import SamplingParams  # noqa: E402


def prefill_rates(engine, rng: random.Random, prompts: int, length: int) -> list[float]:
    """tok/s of `prompts` distinct prompts of `length` tokens, one at a time (one token each)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rates = []
    for _ in range(prompts):
        prompt = [rng.randrange(10, 2000) for _ in range(length)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        rates.append(length / (time.perf_counter() - t))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--images", type=int, default=8, help="--prefix-cache-images (device images)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    cfg, _ = bench_config("flash-next", a.layers, None)
    model = random_flash_next(cfg, device, dtype, seed=0)
    base = dict(max_concurrency=4, max_context=8192, prefix_cache_images=a.images, cuda_graph=False,
                warm_up=False)  # fmt: skip
    engines = {name: engine_for_model(model, device, dtype, **base, host_state_slots=slots)
               for name, slots in (("store_on", 64), ("store_off", 0))}  # fmt: skip
    rng = random.Random(0)
    for engine in engines.values():  # first use (Triton compiles) outside the rounds
        prefill_rates(engine, rng, 2, a.length)
    rounds: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(a.rounds):
        for name, engine in engines.items():
            rounds[name].append(round(statistics.median(prefill_rates(engine, rng, a.prompts, a.length)), 1))
    modes = {
        name: {"median_tok_s_per_round": r, "median_tok_s": statistics.median(r),
               "host_images": engines[name].stats()["host_images"]}
        for name, r in rounds.items()
    }  # fmt: skip
    ratio = round(modes["store_on"]["median_tok_s"] / modes["store_off"]["median_tok_s"], 3)
    out = {"benchmark": "bench_host_store_prefill", "git": git_info(), "hardware": hardware(device),
           "command": " ".join(["python", *sys.argv]), "settings": vars(a), "modes": modes,
           "on_over_off": ratio}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
