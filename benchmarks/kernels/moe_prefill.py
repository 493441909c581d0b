"""The grouped Triton routed experts of prefill (`grouped_experts`, ops/triton/moe_grouped.py) against the
per-expert reference loop (`_experts_by_expert`, what CUDA ran before: ~6 launches and a host sync an
expert), at prefill chunk sizes with the real Flash-Next widths (H=2560, E=512, k=10, I=640, bf16): eager
and replayed from a CUDA graph, the useful TFLOP/s (2 * T*k * 3*I*H flops) and the bandwidth achieved on
the bytes of the distinct experts' weights (the floor: each active expert read once); a per-kernel time
breakdown (torch.profiler) and a sweep of the block sizes. Routing: uniform (top-k of uniform scores) and
skewed (scores plus a per-expert bias of std 1, some experts hot). Prints JSON; run on a CUDA machine:
python benchmarks/bench_kernels.py moe_prefill [--quick] [--fp8] [--ab] [--tokens 4096 8192]

--fp8: the experts block-wise FP8 (ops/fp8.py quantize; the kernels dequantize in their tiles), the
bytes and the fp32 oracle those of the FP8 weights. --ab: each T's BLOCK_M candidates (AB) timed in turn,
AB_ROUNDS rounds, medians (one sweep row after another drifts with the clocks of a warm GPU)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from nextserve.bench import copy_bandwidth, git_info, hardware
from nextserve.bench.timing import graph_us as _graph_us
from nextserve.bench.timing import kernel_us as _us
from nextserve.ops.fp8 import Fp8Weight, quantize
from nextserve.ops.moe import _experts_by_expert, default_block_m
from nextserve.ops.triton.moe_grouped import grouped_experts

H, E, K, I = 2560, 512, 10, 640
EXPERT_BYTES = 3 * I * H * 2  # gate, up and down rows of one expert, bf16
TOKENS = (64, 256, 1024)
SWEEP = [
    {},  # the defaults: gate/up 64x64 (4 warps, 4 stages), down 128x64 (4 warps, 4 stages), BLOCK_M by T
    {"block_m": 16},
    {"block_m": 32},
    {"block_m": 64},
    {"block_n": 128, "block_k": 64, "stages": 3},
    {"block_n": 64, "block_k": 128, "stages": 3},
    {"block_n": 32, "block_k": 128, "stages": 4},
    {"block_n": 128, "block_k": 64, "warps": 8, "stages": 3},
    {"block_n_down": 64, "block_k_down": 128, "stages_down": 3},
    {"block_n_down": 256, "block_k_down": 64, "warps_down": 8, "stages_down": 3},
    {"block_n_down": 128, "block_k_down": 128, "stages_down": 3},
    {"stages": 3, "stages_down": 3},
    {"stages": 5, "stages_down": 5},
    {"block_m": 128, "warps": 8, "warps_down": 8},
    {"block_m": 128, "warps": 8, "warps_down": 8, "stages": 3, "stages_down": 3},
    {"block_m": 128, "block_n": 128, "warps": 8, "warps_down": 8, "stages": 3, "stages_down": 3},
]

AB = [{"block_m": 64}, {"block_m": 128, "warps": 8, "warps_down": 8}]
AB_ROUNDS = 7


def _ab(call) -> list[dict]:
    """The AB configs' graph replay µs, interleaved over AB_ROUNDS rounds: medians and the spread."""
    times: list[list[float]] = [[] for _ in AB]
    for _ in range(AB_ROUNDS):
        for i, cfg in enumerate(AB):
            times[i].append(_graph_us(lambda cfg=cfg: call(**cfg)))
    return [{**cfg, "median_us": statistics.median(t), "min_us": min(t), "max_us": max(t)}
            for cfg, t in zip(AB, times, strict=True)]  # fmt: skip


def _breakdown(fn) -> dict[str, float]:
    """Device µs per kernel (by name) of one call, after a warm-up, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if us:
            times[evt.key[:80]] = round(float(us), 1)
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def _routing(T: int, skewed: bool, g: torch.Generator, dev: torch.device):
    scores = torch.rand(T, E, device=dev, generator=g)
    if skewed:
        scores = scores + torch.randn(E, device=dev, generator=g)
    _, ids = scores.topk(K, dim=-1)
    w = torch.rand(T, K, device=dev, generator=g)
    return (w / w.sum(-1, keepdim=True)).to(torch.bfloat16), ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the default configurations only, no sweep")
    ap.add_argument("--fp8", action="store_true", help="block-wise FP8 expert weights")
    ap.add_argument("--ab", action="store_true", help="the two forms of AB taking turns")
    ap.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    args = ap.parse_args()
    quick, fp8, ab, tokens = args.quick, args.fp8, args.ab, args.tokens
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, device=dev, generator=g) / H**0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, I, device=dev, generator=g) / I**0.5).to(torch.bfloat16)
    expert_bytes = EXPERT_BYTES // 2 if fp8 else EXPERT_BYTES
    if fp8:
        gate_up, down = Fp8Weight(*quantize(gate_up)), Fp8Weight(*quantize(down))
    gate_up32, down32 = (w.dequantize(torch.float32) if fp8 else w.float() for w in (gate_up, down))
    rows = []
    for skewed in (False, True):
        for T in tokens:
            x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
            w, ids = _routing(T, skewed, g, dev)
            counts = torch.bincount(ids.flatten(), minlength=E)
            distinct = int((counts > 0).sum())
            flops = 2 * T * K * 3 * I * H
            row = {"T": T, "k": K, "routing": "skewed" if skewed else "uniform",
                   "distinct_experts": distinct, "max_pairs_per_expert": int(counts.max()),
                   "default_block_m": default_block_m(T * K, E),
                   "bytes_distinct": distinct * expert_bytes,
                   "useful_GFLOP": round(flops / 1e9, 2)}  # fmt: skip
            call = lambda x=x, w=w, ids=ids, **cfg: grouped_experts(x, w, ids, gate_up, down, **cfg)  # noqa: E731
            ref = _experts_by_expert(x, w, ids, gate_up, down)
            out = call()
            exact = _experts_by_expert(x.float(), w.float(), ids, gate_up32, down32)
            rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
            row["rel_err_vs_reference"] = rel(out, ref)
            row["rel_err_vs_fp32"] = {"triton": rel(out, exact), "reference": rel(ref, exact)}
            row["deterministic"] = bool(torch.equal(out, call()))
            del exact
            row["reference_loop_us"] = _us(
                lambda x=x, w=w, ids=ids: _experts_by_expert(x, w, ids, gate_up, down)
            )
            row["triton_us"] = _us(call)
            row["triton_graph_us"] = _graph_us(call)
            for key in ("triton_us", "triton_graph_us"):
                row[f"{key[:-3]}_TFLOPs"] = round(flops / (row[key] * 1e-6) / 1e12, 1)
                row[f"{key[:-3]}_GBps_distinct_bytes"] = round(
                    row["bytes_distinct"] / (row[key] * 1e-6) / 1e9
                )
            row["speedup_vs_reference"] = round(row["reference_loop_us"] / row["triton_us"], 1)
            row["kernel_us"] = _breakdown(call)
            if ab and not skewed:
                row["ab"] = _ab(call)
            if not quick and not skewed:
                sweep = []
                for cfg in SWEEP:
                    try:
                        us = _graph_us(lambda cfg=cfg, call=call: call(**cfg))
                        sweep.append({**cfg, "graph_us": us, "TFLOPs": round(flops / (us * 1e-6) / 1e12, 1)})
                    except Exception as exc:  # a config out of shared memory, say
                        sweep.append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                row["block_sweep"] = sweep
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "block_sweep"}), file=sys.stderr)
    out = {"benchmark": "moe_prefill", "git": git_info(None), "hardware": hardware(dev),
           "command": " ".join(["python", *sys.argv]), "sizes": {"H": H, "E": E, "k": K, "I": I},
           "weights": "fp8" if fp8 else "bf16",
           "copy_bandwidth": copy_bandwidth(dev, 1 << 30), "rows": rows}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
