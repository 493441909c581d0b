"""What a verify window costs against a decode step, on the GPU: graph replays of windows of W = 1 + d rows
(d drafts) per sequence, at each batch size, against the decode step's replay (W = 1), in alternating
rounds, on the reference config (flash-next widths, random weights). Also the whole verify path a step runs
(window inputs, replay, sampling, rewind) for windows whose drafts are all rejected.

    python benchmarks/bench_verify_windows.py --concurrency 1 8 --drafts 4

A window of W rows costs `ratio` decode steps; speculation gains where the tokens a window commits on
average (1 + accepted drafts) exceed that ratio. Prints one JSON object (revision, hardware, command,
figures). Timing only: the rows' state advances between replays.
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

from nextserve.bench.model import bench_config, engine_for_model, random_flash_next, start_decoding  # noqa: E402
from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.engine.sampling import SamplingParams  # noqa: E402
from nextserve.engine.scheduler import Chunk  # noqa: E402


def timed(fn, n: int) -> float:
    """Milliseconds per call of fn, n calls, the GPU drained before and after."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="flash-next")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--drafts", type=int, default=4, help="--speculative-tokens")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--revision", default=None, help="record this git revision (a tree copied without .git)")
    a = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    cfg, _ = bench_config(a.preset, a.layers)
    model = random_flash_next(cfg, device, dtype, 0)
    conc = max(a.concurrency)
    max_new = (a.rounds + 2) * (1 + a.drafts) * 64 + 64
    cap = conc * (a.prompt_len + max_new + 64) + 64
    engine = engine_for_model(
        model, device, dtype, max_concurrency=conc, kv_capacity=cap, max_context=cap // conc,
        speculative_method="ngram", speculative_tokens=a.drafts,
    )  # fmt: skip
    engine.scheduler.proposer = None  # plain steps: this script builds the windows itself
    runner, graphs = engine.runner, engine.runner.graphs
    g = torch.Generator().manual_seed(0)
    runs = []
    for c in a.concurrency:
        params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
        start_decoding(engine, c, a.prompt_len, params, g)
        seqs = list(engine.scheduler.running)
        replay: dict[int, list[float]] = {W: [] for W in graphs.windows}
        verify: dict[int, list[float]] = {W: [] for W in graphs.windows[1:]}
        for _ in range(a.rounds):
            for W in graphs.windows:
                # drafts that differ from any greedy token are likely: token 0 repeated (timing only)
                chunks = [
                    Chunk(s, s.num_computed, s.num_computed + W, sample=True, drafts=(0,) * (W - 1))
                    for s in seqs
                ]
                inputs = runner.window_inputs(chunks, W)
                replay[W].append(timed(lambda inputs=inputs: graphs.replay(*inputs), a.replays))
                if W > 1:
                    verify[W].append(timed(lambda chunks=chunks: runner.execute_verifies(chunks), a.replays))
        base = statistics.median(replay[1])
        runs.append(
            {
                "concurrency": c,
                "decode_replay_ms": round(base, 4),
                "windows": [
                    {
                        "rows_per_sequence": W,
                        "replay_ms": [round(x, 4) for x in replay[W]],
                        "ratio_to_decode": round(statistics.median(replay[W]) / base, 3),
                        "verify_path_ms": None if W == 1 else round(statistics.median(verify[W]), 4),
                    }
                    for W in graphs.windows
                ],
            }
        )
        for s in seqs:
            engine.abort(s.request_id)
        while engine.has_unfinished():
            engine.step()
    print(
        json.dumps(
            {
                "benchmark": "bench_verify_windows",
                "git": git_info(a.revision),
                "hardware": hardware(device),
                "command": " ".join(["python", *sys.argv]),
                "settings": vars(a),
                "runs": runs,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
