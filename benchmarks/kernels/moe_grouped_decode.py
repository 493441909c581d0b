"""Decode routed experts at the real Flash-Next sizes (H=2560, E=512, k=10, I=640, bf16) on CUDA:
`routed_experts` (ops/triton/moe_decode.py, a GEMV per (row, expert) pair) against
`grouped_decode_experts` (ops/triton/moe_grouped.py, each active expert read once) at M = 1, 2, 4,
8, 16, 32 rows with random routing, plus a small block-size sweep of the grouped kernel; per M and
config, a strict row-invariance check (each row alone, and among other rows at another position,
torch.equal) and the error against the reference loop `_experts_by_row`.

Timing: one CUDA graph of 20 back-to-back calls, each on its own random routing (x, w, ids), so a call
mostly reads other experts than the call before it (as consecutive layers do); the L2 is flushed (a
256 MB memset, outside the timed region) before each replay, not between the calls of a replay.
µs per call = median over replays of (replay time / 20), from CUDA events. GB/s counts the distinct
experts' weight bytes (each active expert read once: the floor of either kernel).
Prints JSON (progress on stderr); about a minute on an H200:
python benchmarks/bench_kernels.py moe_grouped_decode"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from kernels import parse_no_flags
from nextserve.bench import copy_bandwidth, git_info, hardware
from nextserve.ops.moe import _experts_by_row
from nextserve.ops.triton.moe_decode import routed_experts
from nextserve.ops.triton.moe_grouped import grouped_decode_experts

H, E, K, I = 2560, 512, 10, 640
EXPERT_BYTES = 3 * I * H * 2  # gate, up and down rows of one expert, bf16
ROWS = (1, 2, 4, 8, 16, 32)
CALLS = 20  # calls captured back to back in one graph
REPLAYS = 10  # timed replays (after 2 untimed)
FLUSH_BYTES = 256 << 20
SWEEP = [
    {},  # the defaults: BLOCK_M 16; gate/up 32 x 128 (4 warps, 4 stages); down 64 x 128 (4 warps, 4 stages)
    {"block_n": 16, "block_k": 256},
    {"block_n": 64, "block_k": 64},
    {"block_n": 32, "block_k": 64, "stages": 6},
    {"block_n": 64, "block_k": 128, "warps": 8, "stages": 3},
    {"block_n_down": 32, "block_k_down": 128},
    {"block_n_down": 128, "block_k_down": 64},
    {"block_n_down": 64, "block_k_down": 64, "stages_down": 6},
    {"warps": 2, "warps_down": 2},
    {"stages": 3, "stages_down": 3},
]


def _routings(M: int, g: torch.Generator, dev: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """CALLS random (x, w, ids): ids the top-k of uniform scores, w their normalised scores."""
    sets = []
    for _ in range(CALLS):
        x = torch.randn(M, H, device=dev, generator=g).to(torch.bfloat16)
        top, ids = torch.rand(M, E, device=dev, generator=g).topk(K, dim=-1)
        sets.append((x, (top / top.sum(-1, keepdim=True)).to(torch.bfloat16), ids))
    return sets


def _graph_us(fn, sets, flush: torch.Tensor) -> float:
    """µs per call: a graph of fn on every set back to back, replayed after an L2 flush."""
    for s in sets:  # compile outside the capture
        fn(*s)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*sets[0])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in sets:
            fn(*s)
    times = []
    for r in range(REPLAYS + 2):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if r >= 2:
            times.append(start.elapsed_time(end) * 1e3 / len(sets))
    del graph
    return round(statistics.median(times), 2)


def _row_invariant(fn, sets) -> bool:
    """STRICT: each row of sets[0] alone equals its row in the batch, and its row in a batch of the
    rows of sets[1] where it sits at position M-1-i."""
    x, w, ids = sets[0]
    full = fn(x, w, ids)
    M = x.shape[0]
    for i in range(M):
        if not torch.equal(
            fn(x[i : i + 1].clone(), w[i : i + 1].clone(), ids[i : i + 1].clone())[0], full[i]
        ):
            return False
        if M > 1:
            ox, ow, oids = (t.clone() for t in sets[1])
            j = M - 1 - i
            ox[j], ow[j], oids[j] = x[i], w[i], ids[i]
            if not torch.equal(fn(ox, ow, oids)[j], full[i]):
                return False
    return True


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _gbps(nbytes: float, us: float) -> float:
    return round(nbytes / (us * 1e-6) / 1e9, 1)


def main() -> None:
    parse_no_flags(__doc__)
    t0 = time.time()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, device=dev, generator=g) / H**0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, I, device=dev, generator=g) / I**0.5).to(torch.bfloat16)
    torch.cuda.empty_cache()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    routed = lambda x, w, ids: routed_experts(x, w, ids, gate_up, down)  # noqa: E731
    rows = []
    for M in ROWS:
        sets = _routings(M, g, dev)
        distinct = statistics.mean(int(torch.unique(s[2]).numel()) for s in sets)
        nbytes = distinct * EXPERT_BYTES
        row = {"M": M, "pairs": M * K, "distinct_experts_mean": distinct, "bytes_distinct_mean": nbytes}
        x, w, ids = sets[0]
        ref = _experts_by_row(x, w, ids, gate_up, down)
        out_routed = routed(x, w, ids)
        row["routed_us"] = _graph_us(routed, sets, flush)
        row["routed_GBps_distinct"] = _gbps(nbytes, row["routed_us"])
        row["routed_rel_err_vs_reference"] = _rel(out_routed, ref)
        sweep = []
        for cfg in SWEEP:
            grouped = lambda x, w, ids, cfg=cfg: grouped_decode_experts(x, w, ids, gate_up, down, **cfg)  # noqa: E731
            entry = dict(cfg)
            try:
                out = grouped(x, w, ids)
                entry["us"] = _graph_us(grouped, sets, flush)
            except Exception as exc:  # a config out of shared memory, say
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                sweep.append(entry)
                continue
            entry["GBps_distinct"] = _gbps(nbytes, entry["us"])
            entry["speedup_vs_routed"] = round(row["routed_us"] / entry["us"], 3)
            entry["rel_err_vs_reference"] = _rel(out, ref)
            entry["rel_err_vs_routed"] = _rel(out, out_routed)
            entry["row_invariant"] = _row_invariant(grouped, sets)
            entry["deterministic"] = bool(torch.equal(grouped(x, w, ids), out))
            sweep.append(entry)
        default = sweep[0]
        row["grouped_us"] = default.get("us")
        row["grouped_GBps_distinct"] = default.get("GBps_distinct")
        row["grouped_speedup_vs_routed"] = default.get("speedup_vs_routed")
        row["grouped_row_invariant"] = default.get("row_invariant")
        row["grouped_rel_err_vs_reference"] = default.get("rel_err_vs_reference")
        row["grouped_sweep"] = sweep
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "grouped_sweep"}), file=sys.stderr)
        del sets
    timed = [i for i, e in enumerate(SWEEP) if all("us" in r["grouped_sweep"][i] for r in rows)]
    total = {i: sum(r["grouped_sweep"][i]["us"] for r in rows) for i in timed}
    best = min(total, key=total.get) if total else None
    summary = {
        "us_per_call": {r["M"]: {"routed": r["routed_us"], "grouped": r["grouped_us"]} for r in rows},
        "all_row_invariant": all(e.get("row_invariant", True) for r in rows for e in r["grouped_sweep"]),
        "best_sweep_config_by_sum_over_M": None
        if best is None
        else {"config": SWEEP[best], "sum_us": total[best]},
        "best_sweep_config_per_M": {
            r["M"]: min((e for e in r["grouped_sweep"] if "us" in e), key=lambda e: e["us"], default=None)
            for r in rows
        },
    }
    out = {"benchmark": "moe_grouped_decode", "git": git_info(None), "hardware": hardware(dev),
           "command": " ".join(["python", *sys.argv]), "sizes": {"H": H, "E": E, "k": K, "I": I},
           "timing": f"CUDA graph of {CALLS} back-to-back calls, each on its own random routing; L2 flushed "
                     f"({FLUSH_BYTES >> 20} MB memset, untimed) before each replay, not between calls; "
                     f"median of {REPLAYS} replays / {CALLS}",
           "copy_bandwidth": copy_bandwidth(dev, 1 << 30), "summary": summary, "rows": rows,
           "wall_s": round(time.time() - t0, 1)}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
