"""One engine flag on against off, side by side: two engines around the same random-weight model decode
the same prompts, timed in alternating blocks of steps (A B A B ...), so drift and clocks hit both alike.
Their tokens are checked equal (a speed mode never changes outputs, C1).

    python benchmarks/bench_engine_ab.py --flag pdl --concurrency 1 8 32     # flash-next, 8 layers, bf16

Prints one JSON object (revision, hardware, command, figures).
"""

from __future__ import annotations

import argparse
import dataclasses
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
from nextserve.engine.scheduler import Chunk  # noqa: E402
from nextserve.engine_config import EngineConfig  # noqa: E402


def _decoding(engine) -> bool:
    s = engine.scheduler
    return not s.waiting and all(not q.in_prefill and q.output_ids for q in s.running)


def timed_steps(engine, steps: int) -> float:
    """Milliseconds per engine step over `steps` steps."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1000


def replay_ms(engine, steps: int) -> float | None:
    """Milliseconds per graph replay of the running rows (their state advances: timing only)."""
    graphs, rows = engine.runner.graphs, engine.scheduler.running
    if graphs is None:
        return None
    chunks = [Chunk(s, s.num_computed, s.num_computed + 1, sample=True) for s in rows]
    inputs = engine.runner.window_inputs(chunks, 1)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        graphs.replay(*inputs)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--flag", required=True, help="a boolean EngineConfig field, e.g. pdl or cuda_graph")
    p.add_argument("--preset", default="flash-next")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50, help="decode steps per timed block")
    p.add_argument("--rounds", type=int, default=4, help="timed blocks per engine (alternating)")
    p.add_argument("--revision", default=None, help="git revision to record when the tree has no .git")
    args = p.parse_args()
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    if args.flag not in fields or not isinstance(fields[args.flag].default, bool):
        p.error(f"--flag must name a boolean EngineConfig field, got {args.flag!r}")
    device, dtype = torch.device("cuda"), torch.bfloat16
    cfg, _ = bench_config(args.preset, args.layers)
    model = random_flash_next(cfg, device, dtype, 0)
    conc = max(args.concurrency)
    max_new = conc + args.steps * (2 * args.rounds + 2) + 16
    cap = conc * (args.prompt_len + max_new + 64) + 64
    flags = dict(max_concurrency=conc, kv_capacity=cap, max_context=cap // conc)
    engines = {on: engine_for_model(model, device, dtype, **flags, **{args.flag: on}) for on in (True, False)}
    out = {
        "benchmark": "engine_ab",
        "git": git_info(args.revision),
        "hardware": hardware(device),
        "command": " ".join(["python", *sys.argv]),
        "flag": args.flag,
        "model": {"preset": args.preset, "num_hidden_layers": cfg.num_hidden_layers, "dtype": "bfloat16"},
        "timing": f"engine.step() wall time, {args.rounds} alternating blocks of {args.steps} steps per "
        "engine after all rows decode; the median block",
        "runs": [],
    }
    g = torch.Generator().manual_seed(0)
    for c in args.concurrency:
        prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g) for _ in range(c)]
        prompts = [pr.tolist() for pr in prompts]
        params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
        rids = {on: [e.add_request(pr, params) for pr in prompts] for on, e in engines.items()}
        for e in engines.values():
            while not _decoding(e):
                e.step()
            timed_steps(e, 3)  # warm
        blocks: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                blocks[on].append(timed_steps(engines[on], args.steps))
        toks = {on: [list(e.sequences[i].output_ids) for i in rids[on]] for on, e in engines.items()}
        # NOTE: an engine with async scheduling has read one step fewer (the last one launched runs on)
        n = min(len(t) for ts in toks.values() for t in ts)
        same = [t[:n] for t in toks[True]] == [t[:n] for t in toks[False]]
        run: dict = {"concurrency": c, "same_tokens": same, "tokens_compared": n}
        for on, e in engines.items():
            ms = statistics.median(blocks[on])
            run["on" if on else "off"] = {
                "step_ms": round(ms, 4),
                "tok_per_s": round(c * 1000 / ms, 1),
                "blocks_ms": [round(b, 4) for b in blocks[on]],
                "graph_replay_ms": None if (rp := replay_ms(e, args.steps)) is None else round(rp, 4),
            }
        run["on_over_off_tok_per_s"] = round(run["on"]["tok_per_s"] / run["off"]["tok_per_s"], 4)
        out["runs"].append(run)
        for on, e in engines.items():
            for rid in rids[on]:
                e.abort(rid)
            while e.has_unfinished():
                e.step()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
