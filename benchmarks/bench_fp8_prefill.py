"""FP8 prefill projections (nextserve/ops/triton/fp8_gemm.py) against what they replace and against bf16,
on the prefill projection shapes of the Flash-Next widths, at chunk sizes M:

- bf16: F.linear on a bf16 weight (cuBLAS), the FP8 target;
- dequantize + cuBLAS: ops/fp8.py `dequantize` of the whole weight, then F.linear (the path before);
- one-pass dequantize + cuBLAS: fp8_gemm.triton_dequantize, then F.linear (fp8_prefill_linear above
  FUSED_MAX_ROWS);
- fused W_AS_A / fused B: the kernel with the dequantized tile as the dot's first / second operand;
- fused configs of --sweep: other tile shapes.

Timing: CUDA events around REPS back-to-back calls, median of TRIALS; TFLOP/s = 2*M*N*K / time.
Prints one JSON object: python benchmarks/bench_fp8_prefill.py [--sweep]"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.ops.fp8 import Fp8Weight, quantize  # noqa: E402
from nextserve.ops.triton.fp8_gemm import Config, _config, fp8_linear, triton_dequantize  # noqa: E402

SHAPES = [  # (what, N, K): the FP8 projections of a prefill chunk as the engine runs them (fused rows)
    ("GDN in_proj qkv|z|b|a", 16480, 2560),
    ("QSA in_proj q|k|v|indexer", 13952, 2560),
    ("GDN/QSA out", 2560, 6144),
    ("PLE key|value", 12800, 2560),
]
SWEEP = [
    (128, 256, 64, 8, 3),
    (64, 128, 64, 4, 4),
    (128, 128, 128, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 64, 64, 4, 4),
]
REPS, TRIALS = 10, 7


def timed_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(TRIALS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(REPS):
            fn()
        b.record()
        torch.cuda.synchronize()
        runs.append(a.elapsed_time(b) * 1000 / REPS)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, nargs="+", default=[128, 256, 512, 1024, 4096, 8192])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--revision", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    out = {
        "git": git_info(args.revision),
        "hardware": hardware(dev),
        "command": " ".join(["python", *sys.argv]),
    }
    rows = []
    for what, N, K in SHAPES:
        w = torch.randn(N, K, device=dev) / K**0.5
        q, s = quantize(w)
        fp8 = Fp8Weight(q, s)
        wb = w.bfloat16()
        base = _config(N, K, torch.bfloat16)
        variants = {"fused_w_as_a": base._replace(w_as_a=True), "fused_b": base._replace(w_as_a=False)}
        if args.sweep:
            for bm, bn, bk, warps, stages in SWEEP:
                for a in (True, False):
                    variants[f"fused_{bm}x{bn}x{bk}_w{warps}_s{stages}_{'a' if a else 'b'}"] = Config(
                        bm, bn, bk, 8, warps, stages, a
                    )
        for M in args.m:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            flop = 2 * M * N * K
            row = {"what": what, "N": N, "K": K, "M": M}
            row["bf16_us"] = timed_us(lambda x=x, wb=wb: F.linear(x, wb))
            row["one_pass_dequantize_cublas_us"] = timed_us(
                lambda x=x, fp8=fp8: F.linear(x, triton_dequantize(fp8, torch.bfloat16))
            )
            row["dequantize_cublas_us"] = timed_us(
                lambda x=x, fp8=fp8: F.linear(x, fp8.dequantize(torch.bfloat16))
            )
            ref = F.linear(x.double(), fp8.dequantize(torch.float64))
            for name, cfg in variants.items():
                try:
                    got = fp8_linear(x, fp8, cfg)
                    err = ((got.double() - ref).norm() / ref.norm()).item()
                    row[f"{name}_us"] = timed_us(lambda x=x, fp8=fp8, cfg=cfg: fp8_linear(x, fp8, cfg))
                    row[f"{name}_rel_err"] = float(f"{err:.2e}")
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result
                    row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            for key in [k for k in row if k.endswith("_us")]:
                row[key] = round(row[key], 1)
                row[key.removesuffix("_us") + "_tflops"] = round(flop / row[key] / 1e6, 1)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    out["rows"] = rows
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
