"""nextserve's side of the side-by-side with vLLM: the same workload (benchmarks/reference/workload.py) on
the same checkpoint (benchmarks/reference/make_ckpt.py), measured the way vllm_side.py measures it.

    python benchmarks/nextserve_side.py CKPT OUT.json [--quantization fp8] [--prefill-chunk 8192] ...

Any further `--flag value` is an engine flag (EngineConfig field, dashes for underscores). Token-id
prompts, greedy, ignore_eos, no tokenizer. Beyond vLLM's rows it times one cold 62,700-token prompt as its
own row (the agent's turn 2, cold) and records the first ids of each decode batch, so the two engines'
greedy tokens can be compared. Prints the JSON as it grows and writes it to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "reference"))

import workload as W  # noqa: E402

from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.engine.engine import LLMEngine  # noqa: E402
from nextserve.engine.sampling import SamplingParams  # noqa: E402
from nextserve.engine_config import EngineConfig  # noqa: E402


def engine_flags(argv: list[str]) -> dict:
    """--name value pairs -> EngineConfig fields: integers, numbers, true/false, or text."""
    flags: dict = {}
    for key, value in zip(argv[::2], argv[1::2], strict=True):
        name = key.removeprefix("--").replace("-", "_")
        if name not in EngineConfig.__dataclass_fields__:
            raise SystemExit(f"unknown engine flag {key}")
        flags[name] = {"true": True, "false": False}.get(value, _number(value))
    return flags


def _number(value: str) -> int | float | str:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            continue
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", help="the reference checkpoint (benchmarks/reference/make_ckpt.py)")
    ap.add_argument("out", type=Path, help="the JSON file to write")
    ap.add_argument("flags", nargs=argparse.REMAINDER, help="engine flags: --name value ...")
    args = ap.parse_args()
    ckpt, out = args.ckpt, args.out
    flags = {"skip_tokenizer": True, "max_context": 72 * 1024, "prefix_cache_images": 8} | engine_flags(
        args.flags
    )
    res: dict = {
        "engine": "nextserve",
        "ckpt": ckpt,
        "flags": flags,
        **git_info(),
        "hardware": hardware("cuda" if torch.cuda.is_available() else "cpu"),
    }

    def save() -> None:
        out.write_text(json.dumps(res, indent=1))
        print(
            {k: v for k, v in res.items() if k not in ("hardware", "flags", "stats_after_init")}, flush=True
        )

    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=ckpt, **flags))
    res["engine_init_s"] = round(time.perf_counter() - t0, 1)
    res["stats_after_init"] = engine.stats()
    save()

    def run(prompts, max_tokens, checkpoints=None):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        done = {}
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        ids = [
            engine.add_request(p, sp, checkpoints=tuple(checkpoints[i : i + 1]) if checkpoints else ())
            for i, p in enumerate(prompts)
        ]
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t, [done[i] for i in ids]

    import random

    rng = random.Random(1234)  # the same prompts, in the same order, as vllm_side.py
    run([W.ids(rng, 1024)], 16)
    run([W.ids(rng, 1024) for _ in range(8)], 16)
    run([W.ids(rng, 1024) for _ in range(32)], 16)
    for n in W.PREFILL_LENS:
        ts = [run([W.ids(rng, n)], 1)[0] for _ in range(5 if n <= 1024 else 2)]
        res[f"prefill_{n}_tok_s"] = round(n / statistics.median(ts), 1)
    for b in W.DECODE_BATCHES:
        shape = [W.ids(rng, W.DECODE_PROMPT) for _ in range(b)]
        t1 = statistics.median([run(shape, 1)[0] for _ in range(3)])
        tn, outs = run(shape, W.DECODE_STEPS + 1)
        dec = tn - t1
        res[f"c{b}"] = {
            "decode_tok_s": round(b * W.DECODE_STEPS / dec, 1),
            "t_first_s": round(t1, 4),
            "t_all_s": round(tn, 4),
        }
        res[f"c{b}_first_ids"] = list(outs[0].token_ids[:8])
        save()
    rng = random.Random(99)
    run([W.ids(rng, min(4096, engine.max_context - 1))], 1)
    turns = []
    for i, (prompt, ckp) in enumerate(W.agent_turns()):
        dt, outs = run([prompt], 1, [ckp])
        turns.append({
            "turn": i + 1, "prompt_tokens": len(prompt), "ttft_s": round(dt, 4),
            "cached_tokens": outs[0].cached_tokens, "first_id": outs[0].token_ids[0],
        })  # fmt: skip
    engine.clear_prefix_cache()
    prompt = W.agent_turns()[1][0]
    dt, outs = run([prompt], 1)
    turns.append({
        "turn": "2 cold", "prompt_tokens": len(prompt), "ttft_s": round(dt, 4),
        "cached_tokens": outs[0].cached_tokens, "first_id": outs[0].token_ids[0],
    })  # fmt: skip
    res["agent"] = turns
    if torch.cuda.is_available():
        res["peak_device_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        # a tight pool shows as retries: cudaMalloc failed, the allocator's cache was freed and it tried again
        stats = torch.cuda.memory_stats()
        keys = ("num_alloc_retries", "num_device_alloc", "num_device_free")
        res["allocator"] = {k: stats.get(k) for k in keys}
    res["stats"] = engine.stats()
    save()
    engine.close()


if __name__ == "__main__":
    main()
