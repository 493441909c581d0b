"""Where a GPU decode step's time goes: graph replay vs the whole engine step, and the device time of
every kernel of one eager step, summed by kernel name.

    python benchmarks/profile_decode.py --concurrency 1 8     # flash-next preset, 8 layers, bf16
    python benchmarks/profile_decode.py --concurrency 1 --quantization fp8

Prints one JSON object (revision, hardware, command, figures).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nextserve.bench.model import bench_config, engine_for_model, random_flash_next, start_decoding  # noqa: E402
from nextserve.bench.profile import kernel_table as kernel_table_of  # noqa: E402
from nextserve.bench.profile import profile_prefill  # noqa: E402
from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.engine.sampling import SamplingParams  # noqa: E402
from nextserve.engine.scheduler import Chunk  # noqa: E402


def kernel_table(engine, top: int) -> dict:
    """One eager decode step under torch.profiler: device kernels summed by name (kernel_ms_total, top)."""
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)

    graphs, engine.runner.graphs = engine.runner.graphs, None
    try:
        engine.step()  # warm
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.step()
            sync()
    finally:
        engine.runner.graphs = graphs
    return kernel_table_of(prof, top)


def host_profile(engine, steps: int, top: int = 15) -> list[dict]:
    """cProfile of `steps` engine steps: where the host spends a step (self time per function)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        {
            "self_us_per_step": round(v[2] / steps * 1e6, 1),
            "calls_per_step": v[1] / steps,
            "fn": f"{k[0][-40:]}:{k[1]}:{k[2]}",
        }
        for k, v in rows
    ]


def replay_phases(graphs, inputs, steps: int) -> dict:
    """Host microseconds per replay: filling the inputs, the graph launch call, then waiting for the GPU."""
    rows, tables = inputs
    B = rows.shape[2]
    G = next(b for b in graphs.buckets if b >= B)
    graph = graphs.graphs[(1, G)][0]
    fill = launch = wait = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        graphs._fill(rows, tables, 1, G)
        t1 = time.perf_counter()
        graph.replay()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        fill, launch, wait = fill + t1 - t0, launch + t2 - t1, wait + t3 - t2
    return {k: round(v / steps * 1e6, 1) for k, v in (("fill", fill), ("launch", launch), ("gpu_wait", wait))}


def engine_phases(engine, steps: int) -> dict:
    """Host microseconds per engine step in schedule, execute (which waits for the GPU's tokens) and
    update + output, by timing wrappers around the three calls."""
    spent = {"schedule": 0.0, "execute": 0.0, "update": 0.0, "drain": 0.0}
    wrapped = [(engine.scheduler, "schedule"), (engine.runner, "execute")]
    wrapped += [(engine, "update"), (engine, "drain_finished")]
    originals = [getattr(obj, name) for obj, name in wrapped]

    def timed(fn, key):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t

        return call

    for (obj, name), fn in zip(wrapped, originals, strict=True):
        setattr(obj, name, timed(fn, "drain" if name == "drain_finished" else name))
    try:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - t
    finally:
        for (obj, name), fn in zip(wrapped, originals, strict=True):
            setattr(obj, name, fn)
    out = {k: round(v / steps * 1e6, 1) for k, v in spent.items()}
    out["step"] = round(total / steps * 1e6, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="flash-next")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--quantization",
        choices=["none", "fp8"],
        default="none",
        help="fp8: the projections and experts block-wise FP8 (as `nextserve bench` draws them)",
    )
    p.add_argument("--ple-table", choices=["device", "host"], default="device")
    p.add_argument("--ngram-vocab-base", type=int, default=None, help="n-gram table size (make-model's)")
    p.add_argument("--prefill", action="store_true", help="also profile a prefill of --prompt-len tokens")
    p.add_argument("--revision", default=None, help="git revision to record when the tree has no .git")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg, _ = bench_config(args.preset, args.layers, args.ngram_vocab_base)
    fp8, ple_host = args.quantization == "fp8", args.ple_table == "host"
    model = random_flash_next(cfg, device, dtype, 0, fp8=fp8, ple_host=ple_host)
    conc = max(args.concurrency)
    # NOTE: room for every phase below (and for the decoding the later prompts' prefill steps already
    # run), so each phase sees all its rows; they are aborted at the end.
    max_new = conc + 8 * args.steps + 16
    cap = conc * (args.prompt_len + max_new + 64) + 64
    engine = engine_for_model(
        model,
        device,
        dtype,
        max_concurrency=conc,
        kv_capacity=cap,
        max_context=cap // conc,
        prefix_cache=False,  # the prefill profile's repeats of one prompt run cold
    )
    out = {
        "git": git_info(args.revision),
        "hardware": hardware(device),
        "command": " ".join(["python", *sys.argv]),
        "quantization": args.quantization,
        "runs": [],
    }
    g = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for c in args.concurrency:
        params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
        start_decoding(engine, c, args.prompt_len, params, g)
        engine.step()
        sync()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync()
        step_ms = (time.perf_counter() - t) / args.steps * 1000
        rows = engine.scheduler.running
        inputs = engine.runner.window_inputs(
            [Chunk(s, s.num_computed, s.num_computed + 1, sample=True) for s in rows], 1
        )  # a replay of the same rows (their state advances; timing only)
        replay_ms = None
        if engine.runner.graphs is not None:
            sync()
            t = time.perf_counter()
            for _ in range(args.steps):
                engine.runner.graphs.replay(*inputs)
            sync()
            replay_ms = (time.perf_counter() - t) / args.steps * 1000
            phases = replay_phases(engine.runner.graphs, inputs, args.steps)
        run = {
            "concurrency": c,
            "engine_step_ms": round(step_ms, 3),
            "tok_per_s": round(c * 1000 / step_ms, 1),
        }
        run["graph_replay_ms"] = None if replay_ms is None else round(replay_ms, 3)
        if replay_ms is not None:
            run["replay_phases_us"] = phases
        run["engine_phases_us"] = engine_phases(engine, args.steps)
        run["host_profile"] = host_profile(engine, args.steps)
        run["eager_step"] = kernel_table(engine, args.top)
        out["runs"].append(run)
        for s in list(engine.scheduler.running):
            engine.abort(s.request_id)
        while engine.has_unfinished():
            engine.step()
    if args.prefill:
        prompt = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
        out["prefill"] = profile_prefill(engine, prompt, args.top)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
