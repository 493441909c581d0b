"""The row-invariant Triton routed experts (ops/triton/moe_decode.py) against the per-row reference loop
(`_experts_by_row`, what CUDA ran before), at decode row counts with the real Flash-Next widths
(H=2560, E=512, k=10, I=640, bf16), eager and replayed from a CUDA graph, with the bandwidth achieved on
the expert weight bytes read; and a small sweep of the block sizes. Prints JSON; run on a CUDA machine:
python benchmarks/bench_kernels.py moe_decode"""

from __future__ import annotations

import json
import sys

import torch

from kernels import parse_no_flags
from nextserve.bench import copy_bandwidth, git_info, hardware
from nextserve.bench.timing import graph_us as _graph_us
from nextserve.bench.timing import kernel_us as _us
from nextserve.ops.moe import _experts_by_row
from nextserve.ops.triton.moe_decode import routed_experts

H, E, K, I = 2560, 512, 10, 640
EXPERT_BYTES = 3 * I * H * 2  # gate, up and down rows of one expert, bf16
ROWS = (1, 8, 32)
SWEEP = [
    {},  # the defaults: gate/up 16x256 (4 warps), down 8x128 (4 warps)
    {"block_i": 32, "block_k": 128},
    {"block_i": 8, "block_k": 512},
    {"block_i": 32, "block_k": 256, "warps_gate_up": 8},
    {"block_h": 16, "block_i_down": 64, "warps_down": 8},
    {"block_h": 8, "block_i_down": 64},
    {"block_h": 4, "block_i_down": 128},
]


def _gbps(nbytes: int, us: float) -> float:
    return round(nbytes / (us * 1e-6) / 1e9, 1)


def main() -> None:
    parse_no_flags(__doc__)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, device=dev, generator=g) / H**0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, I, device=dev, generator=g) / I**0.5).to(torch.bfloat16)
    rows = []
    for M in ROWS:
        x = torch.randn(M, H, device=dev, generator=g).to(torch.bfloat16)
        w, ids = torch.rand(M, E, device=dev, generator=g).topk(K, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
        pairs, distinct = M * K, int(torch.unique(ids).numel())
        row = {"M": M, "k": K, "distinct_experts": distinct, "bytes_per_row_expert": pairs * EXPERT_BYTES}
        row["bytes_distinct"] = distinct * EXPERT_BYTES
        ref = _experts_by_row(x, w, ids, gate_up, down)
        out = routed_experts(x, w, ids, gate_up, down)
        row["rel_err_vs_reference"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        row["reference_per_row_us"] = _us(lambda x=x, w=w, ids=ids: _experts_by_row(x, w, ids, gate_up, down))
        row["triton_us"] = _us(lambda x=x, w=w, ids=ids: routed_experts(x, w, ids, gate_up, down))
        row["triton_graph_us"] = _graph_us(lambda x=x, w=w, ids=ids: routed_experts(x, w, ids, gate_up, down))
        for key in ("triton_us", "triton_graph_us"):
            row[f"{key[:-3]}_GBps_row_expert_bytes"] = _gbps(row["bytes_per_row_expert"], row[key])
            row[f"{key[:-3]}_GBps_distinct_bytes"] = _gbps(row["bytes_distinct"], row[key])
        row["speedup_vs_reference"] = round(row["reference_per_row_us"] / row["triton_us"], 1)
        sweep = []
        for cfg in SWEEP:
            us = _graph_us(lambda x=x, w=w, ids=ids, cfg=cfg: routed_experts(x, w, ids, gate_up, down, **cfg))
            sweep.append({**cfg, "graph_us": us, "GBps_row_expert_bytes": _gbps(pairs * EXPERT_BYTES, us)})
        row["block_sweep"] = sweep
        rows.append(row)
    out = {"benchmark": "moe_decode", "git": git_info(None), "hardware": hardware(dev),
           "command": " ".join(["python", *sys.argv]), "sizes": {"H": H, "E": E, "k": K, "I": I},
           "copy_bandwidth": copy_bandwidth(dev, 1 << 30), "rows": rows}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
