"""The prefill GDN recurrence of one layer (one sequence, one chunk of T tokens) at the real Flash-Next
sizes (Hk 16, Hv 48, dk = dv 128, bf16 q/k/v, float32 state): per-call microseconds of the fused Triton
kernel (ops/triton/gdn_chunk.py) at T = 1, 64, 1024, against the token-by-token torch reference loop and
T successive one-token decode-kernel launches, both at T = 64. Prints JSON; run on a CUDA machine:
python benchmarks/bench_kernels.py gdn_chunk"""

from __future__ import annotations

import json
import sys

import torch
import triton.testing

from kernels import parse_no_flags
from nextserve.bench import git_info, hardware
from nextserve.ops.gdn import gated_delta_rule_reference
from nextserve.ops.triton.gdn_chunk import triton_gated_delta_rule
from nextserve.ops.triton.gdn_step import triton_recurrent_step

HK, HV, DK, DV = 16, 48, 128, 128
KERNEL_TS = (1, 64, 1024)
BASELINE_T = 64


def _us(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median") * 1e3


def _inputs(T: int, g: torch.Generator):
    """q, k, v as views into one [T, conv_dim] activation, as the model slices them."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    kd = HK * DK
    x = torch.randn(T, 2 * kd + HV * DV, device=dev, dtype=dt, generator=g)
    q = x[:, :kd].view(T, HK, DK)
    k = x[:, kd : 2 * kd].view(T, HK, DK)
    v = x[:, 2 * kd :].view(T, HV, DV)
    gate = -torch.rand(T, HV, device=dev, generator=g) * 0.2
    beta = torch.rand(T, HV, device=dev, generator=g).to(dt)
    state = torch.randn(HV, DK, DV, device=dev, generator=g) * 0.5
    return q, k, v, gate, beta, state


def _decode_steps(q, k, v, gate, beta, plane, slots):
    for t in range(v.shape[0]):
        s = slice(t, t + 1)
        triton_recurrent_step(q[s], k[s], v[s], gate[s], beta[s], plane, slots)


def main() -> None:
    parse_no_flags(__doc__)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for T in KERNEL_TS:
        args = _inputs(T, g)
        us = _us(lambda a=args: triton_gated_delta_rule(*a))
        rows.append({"op": "triton_gated_delta_rule", "T": T, "us": us, "us_per_token": us / T})
    args = _inputs(BASELINE_T, g)
    us = _us(lambda: gated_delta_rule_reference(*args))
    rows.append({"op": "torch_reference_loop", "T": BASELINE_T, "us": us, "us_per_token": us / BASELINE_T})
    plane = args[5].clone().unsqueeze(0)
    slots = torch.zeros(1, dtype=torch.int64, device=dev)
    us = _us(lambda: _decode_steps(*args[:5], plane, slots))
    rows.append({"op": "decode_kernel_x_T", "T": BASELINE_T, "us": us, "us_per_token": us / BASELINE_T})
    kernel_64 = next(r["us"] for r in rows if r["op"] == "triton_gated_delta_rule" and r["T"] == BASELINE_T)
    ref_64 = next(r["us"] for r in rows if r["op"] == "torch_reference_loop")
    out = {"benchmark": "gdn_chunk", "git": git_info(None), "hardware": hardware(dev),
           "command": " ".join(["python", *sys.argv]), "shape": {"Hk": HK, "Hv": HV, "dk": DK, "dv": DV},
           "speedup_vs_reference_at_T64": ref_64 / kernel_64, "rows": rows}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
