"""The memory-bound kernels of a prefill chunk at Flash-Next's widths (4,096 rows, bf16): each op as the model
calls it (its inputs' strides included), its median time, the bytes it must move at least (inputs read once,
outputs written once) and so the fraction of the H200's HBM bandwidth it reaches. With --sweep, each kernel's
module constants (tiles, warps) are varied in the same process (a different constant recompiles the kernel).

    python benchmarks/bench_kernels.py prefill_pointwise [--rows 4096] [--sweep] [--revision NAME]

Prints JSON. CUDA only. The constants are part of the numerics of some kernels (not of a row's bits within
a chunk): a sweep only times them.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton.testing

from nextserve.bench import git_info, hardware  # noqa: E402
from nextserve.ops.conv import conv_chunk  # noqa: E402
from nextserve.ops.hyper import inject, mix_streams, scaled_silu  # noqa: E402
from nextserve.ops.norms import rms_norm, rms_norm_gated  # noqa: E402
from nextserve.ops.pointwise import sigmoid_gate  # noqa: E402

HBM_TBS = 4.8  # H200 peak, TB/s
H, N_HC, R, E = 2560, 4, 320, 512
HK, HV, DK = 16, 48, 128
NQ, D = 24, 256


def _bytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def cases(T: int) -> dict:
    """name -> (fn, bytes moved at least)."""
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=bf):
        return torch.randn(*shape, generator=g, device=dev).to(dtype)

    nh = N_HC * H
    conv_dim = 2 * HK * DK + HV * DK  # 10240
    gdn_in = rnd(T, conv_dim + HV * DK + 2 * HV + 80)[:, :]  # the stacked in_proj output (padded rows)
    qkv, z = gdn_in[:, :conv_dim], gdn_in[:, conv_dim : conv_dim + HV * DK].reshape(T, HV, DK)
    conv_w, conv_hist = rnd(conv_dim, 4), rnd(conv_dim, 3)
    parts = (HK * DK, HK * DK, HV * DK)
    ple_x, ple_w, ple_hist = rnd(T, nh), rnd(nh, 4), rnd(nh, 9)
    o_gdn, w_gdn = rnd(T, HV, DK), rnd(DK)
    x_hc, w_hc = rnd(T, nh), rnd(nh)
    xn, logits = rnd(T, nh), rnd(T, nh)
    down = rnd(T, R + N_HC + 4)  # the padded down|inject GEMM output
    y = rnd(T, H)
    qg, w_q = rnd(T, NQ, 2 * D), rnd(D)  # q_proj's [q_h | gate_h] per head
    o_qsa = rnd(T, NQ * D)
    router = rnd(T, E + 1 + 7)  # router logits | shared gate (+ padding)
    shared, routed = rnd(T, H), rnd(T, H)
    return {
        "conv_gdn_parts": (
            lambda: conv_chunk(qkv, conv_hist, conv_w, silu=True, parts=parts),
            2 * _bytes(qkv),
        ),
        "conv_ple_dil3": (lambda: conv_chunk(ple_x, ple_hist, ple_w, 3, silu=True), 2 * _bytes(ple_x)),
        "rms_norm_hc_g2560": (lambda: rms_norm(x_hc, w_hc, 1e-6, group=H), 2 * _bytes(x_hc)),
        "rms_norm_gated_gdn": (
            lambda: rms_norm_gated(o_gdn, z, w_gdn, 1e-6, "sigmoid"),
            3 * _bytes(o_gdn),
        ),
        "rms_norm_qsa_q": (lambda: rms_norm(qg[..., :D], w_q, 1e-6), 2 * T * NQ * D * 2),
        "mix_streams": (lambda: mix_streams(logits, xn, N_HC, H), _bytes(logits, xn, y)),
        "inject": (lambda: inject(x_hc, y, down[:, R : R + N_HC], N_HC), 2 * _bytes(x_hc) + _bytes(y)),
        "scaled_silu": (lambda: scaled_silu(down[:, :R], N_HC), 2 * T * R * 2),
        "sigmoid_gate_qsa": (lambda: sigmoid_gate(o_qsa, qg[..., D:]), 3 * _bytes(o_qsa)),
        "sigmoid_gate_shared": (
            lambda: sigmoid_gate(shared, router[:, E : E + 1], routed),
            4 * _bytes(shared),
        ),
    }


# module -> constants to vary, each a list of values (the first is the module's own)
SWEEP = {
    "nextserve.ops.triton.conv_chunk": {
        "ROWS": [32, 16, 64, 0],
        "ROWS_BLOCK_C": [512, 1024, 256],
        "ROWS_WARPS": [4, 8, 2],
        "BLOCK_T": [16, 32, 8],
    },
    "nextserve.ops.triton.gates": {"BLOCK": [1024, 2048, 4096, 512], "NUM_WARPS": [4, 8]},
    "nextserve.ops.triton.hyper": {"BLOCK": [1024, 2048, 512], "NUM_WARPS": [4, 8]},
    "nextserve.ops.triton.norms": {"TILE": [1024, 4096, 8192]},
}
USES = {
    "nextserve.ops.triton.conv_chunk": ("conv_gdn_parts", "conv_ple_dil3"),
    "nextserve.ops.triton.gates": ("sigmoid_gate_qsa", "sigmoid_gate_shared"),
    "nextserve.ops.triton.hyper": ("mix_streams", "inject", "scaled_silu"),
    "nextserve.ops.triton.norms": ("rms_norm_hc_g2560", "rms_norm_gated_gdn", "rms_norm_qsa_q"),
}


def _time(fn, nbytes: int) -> dict:
    us = triton.testing.do_bench(fn, warmup=20, rep=200, return_mode="median") * 1e3
    return {
        "us": round(us, 2),
        "gb": round(nbytes / 1e9, 4),
        "hbm_frac": round(nbytes / (us * 1e-6) / (HBM_TBS * 1e12), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--revision", default=None)
    args = ap.parse_args()
    ops = cases(args.rows)
    res = {
        "bench": "prefill_pointwise",
        "rows": args.rows,
        **git_info(args.revision),
        "hardware": hardware("cuda"),
    }
    res["ops"] = {name: _time(fn, nb) for name, (fn, nb) in ops.items()}
    print(json.dumps(res["ops"]), file=sys.stderr, flush=True)
    if args.sweep:
        import importlib

        res["sweep"] = []
        for mod_name, consts in SWEEP.items():
            mod = importlib.import_module(mod_name)
            for const, values in consts.items():
                own = getattr(mod, const, None)
                if own is None:
                    continue
                for v in values[1:]:
                    setattr(mod, const, v)
                    for name in USES[mod_name]:
                        row = {"module": mod_name.rsplit(".", 1)[1], const: v, "op": name}
                        try:
                            row |= _time(*ops[name])
                        except Exception as e:  # a tile too big for a kernel's registers or shared memory
                            row["error"] = repr(e)[:200]
                        res["sweep"].append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
                setattr(mod, const, own)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
