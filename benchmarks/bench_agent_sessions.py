"""Agent sessions: how many requests without max_tokens run at once, a 16-session agent
workload with prefix reuse on (the default) against off, and the cost of one preempt + resume.

    python benchmarks/bench_agent_sessions.py [--layers 8] [--sessions 16] [--out FILE]

Random weights drawn on the device (flash-next widths, `nextserve.bench.random_flash_next`), token-id
prompts, greedy. Prints one JSON object.
- fit: 64 requests of 1,024-token prompts with no max_tokens against --max-concurrency 64: how many the
  engine admits at once, and how many admission used to (the pool's tokens // max_context: each reserved
  a whole context);
- agent: `--sessions` sessions, each a shared system prompt + its own history; three turns, each the last
  prompt + the reply (64 tokens) + a new 256-token message, all sessions' turn n sent together; mean TTFT
  per turn and output tok/s, with prefix reuse on and with --no-prefix-cache, and the outputs compared;
- preempt: one decoding sequence of a 62,000-token prompt moved to host memory and back (seconds, bytes;
  `swap_out_host_s`: what the engine's host thread spent, the copy itself running on a copy stream);
- host_store (`--device-images N`): the agent workload with N device images (fewer than the sessions, so
  images leave the device) and the host image store on (64 images within --host-kv-mib) against off.
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
from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.engine.sampling import SamplingParams  # noqa: E402

SCALE = 1.0  # --scale: every length times this (a CPU smoke run on the tiny preset)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 200) for _ in range(max(1, int(n * SCALE)))]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_turn(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list, list[float], float]:
    """All prompts at once: (outputs, each one's TTFT, wall seconds)."""
    sync()
    t0 = time.perf_counter()
    rids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    done: dict[str, object] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
            if out.finished:
                done[out.request_id] = out
    sync()
    return [done[r] for r in rids], [first[r] for r in rids], time.perf_counter() - t0


def fit(engine, max_context: int) -> dict:
    rng = random.Random(1)
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(ids(rng, 1024), params) for _ in range(64)]
    for _ in range(3):
        engine.step()
    running = engine.stats()["running"]
    for r in rids:
        engine.abort(r)
    engine.step()
    engine.clear_prefix_cache()
    tokens = engine.pool.num_pages * engine.pool.page_size
    return {"admitted_at_once": running, "before_pool_tokens_over_max_context": tokens // max_context,
            "pool_tokens": tokens, "max_context": max_context}  # fmt: skip


def agent(engine, sessions: int, seed: int = 7) -> dict:
    rng = random.Random(seed)
    system = ids(rng, 2048)
    prompts = [system + ids(rng, 4096) for _ in range(sessions)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    turns, replies = [], []
    for turn in range(3):
        outs, ttft, wall = run_turn(engine, prompts, params)
        turns.append({
            "turn": turn + 1, "mean_prompt_tokens": statistics.mean(len(p) for p in prompts),
            "mean_ttft_s": round(statistics.mean(ttft), 4), "wall_s": round(wall, 3),
            "out_tok_s": round(sum(len(o.token_ids) for o in outs) / wall, 1),
            "cached_tokens": sum(o.cached_tokens for o in outs),
        })  # fmt: skip
        replies.append([o.token_ids for o in outs])
        prompts = [p + o.token_ids + ids(rng, 256) for p, o in zip(prompts, outs, strict=True)]
    return {"turns": turns, "replies": replies}


def preempt_cost(engine, prompt_len: int) -> dict:
    rng = random.Random(3)
    rid = engine.add_request(
        ids(rng, prompt_len), SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    )
    seq = engine.sequences[rid]
    while not seq.output_ids:
        engine.step()
    for _ in range(4):
        engine.step()
    sched = engine.scheduler
    nbytes = sched.swapper.copy_bytes(seq)
    sync()
    t0 = time.perf_counter()
    sched.preempt(seq)
    t_host = time.perf_counter() - t0
    sync()
    t_out = time.perf_counter() - t0
    t0 = time.perf_counter()
    sched._admit()
    sync()
    t_in = time.perf_counter() - t0
    assert seq.cache is not None and not sched.swapper.holds(seq)
    engine.abort(rid)
    engine.step()
    return {"context_tokens": seq.num_computed, "copy_bytes": nbytes, "swap_out_s": round(t_out, 4),
            "swap_out_host_s": round(t_host, 4),
            "swap_in_s": round(t_in, 4), "GB_per_s_out": round(nbytes / t_out / 1e9, 2),
            "GB_per_s_in": round(nbytes / t_in / 1e9, 2)}  # fmt: skip


def compare(
    model, device, dtype, base: dict, modes: dict, args, max_context: int, key: str, measure: bool
) -> dict:
    """The agent workload on an engine of each of two modes (with `measure`, the first engine also measures
    fit and preempt): per mode its turns, the outputs compared, and the mean-TTFT ratio second / first."""
    res, results = {}, {}
    for name, flags in modes.items():
        engine = engine_for_model(model, device, dtype, **base, **flags)
        results[name] = {"prefix_images": engine.plan.prefix_images if engine.plan else None}
        if measure:
            res["fit"] = fit(engine, max_context)
            res["preempt"] = preempt_cost(engine, min(62000, int(max_context / args.scale) - 2048))
            measure = False
        if args.warm_pass:  # the same workload on other prompts first, then nothing cached
            results[name]["warm_pass"] = agent(engine, args.sessions, seed=99)["turns"]
            engine.clear_prefix_cache()
        hits = engine.stats()["host_image_hits"]
        results[name] |= agent(engine, args.sessions)
        results[name]["host_hits"] = engine.stats()["host_image_hits"] - hits
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
    first, second = (results[n] for n in modes)
    res[f"{key}_identical_outputs"] = first.pop("replies") == second.pop("replies")
    res[key] = results
    res[f"{key}_ratio_mean_ttft_{'_over_'.join(reversed(list(modes)))}"] = [
        round(b["mean_ttft_s"] / a["mean_ttft_s"], 2)
        for a, b in zip(first["turns"], second["turns"], strict=True)
    ]
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--max-context", type=int, default=65536)
    p.add_argument("--scale", type=float, default=1.0, help="lengths times this (CPU smoke: 0.02)")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--device-images", type=int, default=0, help="also the host store on/off at N device images"
    )
    p.add_argument(
        "--host-kv-mib", type=int, default=16384, help="the host store's budget in that comparison"
    )
    p.add_argument("--no-prefix-comparison", action="store_true", help="skip fit, preempt and prefix on/off")
    p.add_argument("--warm-pass", action="store_true", help="each engine runs the workload once first")
    p.add_argument("--fit-only", action="store_true", help="only fit and preempt (the 48-layer run)")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none")
    p.add_argument("--ple-table", choices=["device", "host"], default="device")
    p.add_argument("--ngram-vocab-base", type=int, default=None, help="n-gram table size (make-model's)")
    args = p.parse_args()
    global SCALE
    SCALE = args.scale
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    preset = "flash-next" if device.type == "cuda" else "tiny"
    cfg, _ = bench_config(preset, args.layers, args.ngram_vocab_base)
    res = {
        "benchmark": "agent_sessions",
        "command": " ".join(sys.argv),
        **git_info(),
        "hardware": hardware(device),
    }
    fp8, ple_host = args.quantization == "fp8", args.ple_table == "host"
    model = random_flash_next(cfg, device, dtype, seed=0, fp8=fp8, ple_host=ple_host)
    max_context = min(int(args.max_context * args.scale), cfg.max_position_embeddings)
    base = dict(max_concurrency=64, max_context=max_context, prefill_chunk=max(16, int(1024 * args.scale)))
    if device.type == "cpu":
        base |= dict(page_size=16, kv_capacity=8 * max_context)
    if args.fit_only:
        engine = engine_for_model(model, device, dtype, **base)
        res["memory_plan"] = engine.plan.table() if engine.plan else None
        res["fit"] = fit(engine, max_context)
        res["preempt"] = preempt_cost(engine, min(62000, int(max_context / args.scale) - 2048))
        engine.close()
    elif not args.no_prefix_comparison:
        modes = {"prefix_on_default": {}, "prefix_off": {"prefix_cache": False}}
        res |= compare(model, device, dtype, base, modes, args, max_context, "agent", True)
    if args.device_images and not args.fit_only:
        store = dict(prefix_cache_images=args.device_images, host_kv_mib=args.host_kv_mib)
        modes = {
            "host_store_on": store | {"host_state_slots": 64},
            "host_store_off": store | {"host_state_slots": 0},
        }
        res |= compare(
            model, device, dtype, base, modes, args, max_context, "host_store", args.no_prefix_comparison
        )
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
