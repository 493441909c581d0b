#!/usr/bin/env python3
"""Decode-step blocks at the real Flash-Next widths, timed alone on the GPU: one hyper-connection mix
(norm, down|inject, activation, up, stream mix) and one MoE block (router, shared expert, routed experts),
as the installed `nextserve` package runs them in a decode step (row-invariant, bf16, random weights).

Run it with two packages on PYTHONPATH in turn (e.g. a revision's copy and the working tree) to compare
kernel changes side by side in one device session. Timing: a CUDA graph of REPS calls, replayed, median
of TRIALS; the weights (about 13 MB for the mix, 1.3 GB for all experts) come mostly from HBM. Prints one
JSON object (git revision, hardware, command)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from types import SimpleNamespace

import torch

from nextserve.bench import git_info, hardware
from nextserve.model.hyper import GatedResidual
from nextserve.model.moe import SparseMoe
from nextserve.ops.pdl import pdl_mode

REPS, REPLAYS, TRIALS = 16, 10, 7
CFG = SimpleNamespace(hc_count=4, hidden_size=2560, rms_norm_eps=1e-6, hc_hidden=4 * 2560, hc_lowrank=320,
                      num_experts=512, num_experts_per_tok=10, norm_topk_prob=True, moe_intermediate_size=640,
                      shared_expert_intermediate_size=640)  # fmt: skip


def _randomize(m: torch.nn.Module, dev: torch.device) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    for p in m.parameters():
        p.data = (torch.randn(p.shape, device=dev, generator=g) / p.shape[-1] ** 0.5).to(torch.bfloat16)
    m.fuse()


def graph_us(fn) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(TRIALS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(REPLAYS):
            graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (REPLAYS * REPS))
    return round(statistics.median(times), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--label", default="")
    ap.add_argument("--revision", default=None)
    ap.add_argument("--plan-small", type=int, default=None, help="moe_plan.PLAN_SMALL for this run")
    ap.add_argument(
        "--pdl",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="programmatic dependent launch in the graphs, as the engine's default (--pdl)",
    )
    args = ap.parse_args()
    if args.plan_small is not None:
        from nextserve.ops.triton import moe_plan

        moe_plan.PLAN_SMALL = args.plan_small
    dev = torch.device("cuda")
    hc, moe = GatedResidual(CFG), SparseMoe(CFG)
    _randomize(hc, dev)
    _randomize(moe, dev)
    rows = []
    with torch.inference_mode(), pdl_mode(args.pdl):
        for M in args.m:
            x = torch.randn(M, CFG.hc_hidden, device=dev).bfloat16()
            u = torch.randn(M, CFG.hidden_size, device=dev).bfloat16()
            rows.append({"M": M, "hc_mix_us": graph_us(lambda x=x: hc.mix(x, True)),
                         "moe_us": graph_us(lambda u=u: moe(u, True))})  # fmt: skip
            print(f"# M={M}: {rows[-1]}", file=sys.stderr)
    out = {"benchmark": "decode_blocks", "label": args.label, "pdl": args.pdl, "git": git_info(args.revision),
           "hardware": hardware(dev), "command": " ".join(["python", *sys.argv]), "rows": rows}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
