"""The row-invariant Triton small-M GEMM (nextserve/ops/triton/gemv.py: split-K, config from (N, K, dtype))
against the previous kernel (a copy below: cdiv(N, 32) programs, each over all of K) and one plain
cuBLAS call (F.linear, not row-invariant), on every decode projection shape of the real Flash-Next
widths at M = 1, 8, 32 (bf16), and a per-decode-step estimate: the sum over the shapes of calls x us.

Timing: CUDA graphs and CUDA events. A graph holds REPS x [L2 flush, call]; a second one REPS x [L2 flush];
us per call = (replay time of the first - of the second) / REPS, median of TRIALS. The flush reads a
buffer of 3x the L2 size (a read, so no dirty lines are written back during the call), so every call
streams its weight from HBM, as in a decode step, where the weights (GBs) never stay in L2; the
difference includes the call's launch gap inside a graph. `us_warm` is REPS back-to-back calls in a
graph without the flush (weights under ~50 MB then come from L2: a floor, not a decode-step cost).

Prints one JSON object; run on a CUDA machine: python benchmarks/bench_kernels.py small_m_gemm
(--sweep adds, per shape at M=1, a sweep of block sizes, split counts and stages around the default;
a few minutes, mostly compiling.)"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nextserve.bench import copy_bandwidth, git_info, hardware
from nextserve.ops.triton.gemv import small_m_linear
from nextserve.ops.triton.gemv_config import gemv_config, k_splits

# (what, N, K, calls per decode step); a shape listed twice is measured once
SHAPES = [  # the decode step's projections as the engine runs them (stacked by fuse_projections)
    ("lm_head", 248320, 2560, 1),
    ("GDN in_proj qkv|z|b|a (6 layers)", 16480, 2560, 6),
    ("QSA in_proj q|k|v|indexer (2 layers)", 13952, 2560, 2),
    ("PLE key|value", 12800, 2560, 1),
    ("GDN/QSA out (8 layers)", 2560, 6144, 8),
    ("hyper-connections down|inject (8 layers x 2)", 324, 10240, 16),
    ("hyper-connections mixer down", 320, 10240, 1),
    ("hyper-connections up (8 layers x 2, mixer)", 10240, 320, 17),
    (
        "MoE router|shared-expert gate (8 layers; the shared expert rides the grouped expert kernels)",
        513,
        2560,
        8,
    ),
]
REPS, REPLAYS, TRIALS = 20, 10, 7


# ---- the previous kernel (commit 053593a), kept for the side-by-side -----------------------------------
@triton.jit
def _legacy_gemm(
    x_ptr, w_ptr, y_ptr, M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :],
            mask=(rm[:, None] < M) & (rk[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + rn[None, :] * stride_wn + rk[:, None],
            mask=(rn[None, :] < N) & (rk[:, None] < K),
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


def legacy_small_m_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _legacy_gemm[(triton.cdiv(N, 32), triton.cdiv(M, 16))](
        x, weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return y


# ---- timing ------------------------------------------------------------------------------------------
class Timer:
    def __init__(self, dev: torch.device) -> None:
        l2 = torch.cuda.get_device_properties(dev).L2_cache_size
        self.flush_buf = torch.ones(max(3 * l2, 64 << 20) // 4, dtype=torch.float32, device=dev)
        self.flush_us = 0.0

    def flush(self) -> None:
        self.flush_buf.sum()  # reads 3x L2: evicts the weight (clean lines, nothing to write back)

    def graph_us(self, fn, flush: bool) -> float:
        """Median us per REPS-th of a graph replay of REPS x [flush (if), fn (if)]."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (and Triton's compile) outside the capture
            for _ in range(2):
                if fn is not None:
                    fn()
                if flush:
                    self.flush()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(REPS):
                if flush:
                    self.flush()
                if fn is not None:
                    fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(TRIALS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(REPLAYS):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / (REPLAYS * REPS))
        del graph
        return statistics.median(times)

    def cold_us(self, fn) -> float:
        return max(0.0, self.graph_us(fn, flush=True) - self.flush_us)

    def rebase(self) -> None:
        self.flush_us = self.graph_us(None, flush=True)


def _gbps(nbytes: int, us: float) -> float:
    return round(nbytes / us / 1e3, 1) if us > 0 else float("inf")


def _check(w: torch.Tensor, x: torch.Tensor) -> dict:
    """The new kernel against float64 F.linear, and rows alone/sub-batch against the full call."""
    full = small_m_linear(x, w)
    ref = F.linear(x.double(), w.double())
    rel = ((full.double() - ref).norm() / ref.norm()).item()
    M = x.shape[0]
    inv = all(torch.equal(small_m_linear(x[i : i + 1], w)[0], full[i]) for i in {0, M // 2, M - 1})
    inv = inv and torch.equal(small_m_linear(x[: (M + 1) // 2].clone(), w), full[: (M + 1) // 2])
    return {"rel_err_vs_fp64": float(f"{rel:.3g}"), "rows_invariant": bool(inv)}


def _row(timer: Timer, w: torch.Tensor, x: torch.Tensor) -> dict:
    (N, K), M = w.shape, x.shape[0]
    cfg = gemv_config(N, K, w.dtype)
    row = {"N": N, "K": K, "M": M, "weight_bytes": N * K * w.element_size(),
           "config": cfg._asdict(), "programs": triton.cdiv(M, 16) * triton.cdiv(N, cfg.block_n) * cfg.splits,
           "legacy_programs": triton.cdiv(M, 16) * triton.cdiv(N, 32)}  # fmt: skip
    fns = {"new": lambda: small_m_linear(x, w), "old": lambda: legacy_small_m_linear(x, w),
           "cublas": lambda: F.linear(x, w)}  # fmt: skip
    timer.rebase()
    for name, fn in fns.items():
        us = timer.cold_us(fn)
        row[f"{name}_us"] = round(us, 2)
        row[f"{name}_GBps"] = _gbps(row["weight_bytes"], us)
    for name, fn in fns.items():
        row[f"{name}_us_warm"] = round(timer.graph_us(fn, flush=False), 2)
    row["new_vs_old"] = round(row["old_us"] / row["new_us"], 2) if row["new_us"] else None
    if M > 16:  # the 32-row block (the default at M > 16) against two 16-row blocks: time, same bits?
        row["block_m16_us"] = round(timer.cold_us(lambda: small_m_linear(x, w, block_m=16)), 2)
        row["block_m32_equal"] = bool(torch.equal(small_m_linear(x, w, block_m=16), small_m_linear(x, w)))
    row.update(_check(w, x))
    return row


def _sweep(timer: Timer, w: torch.Tensor, x: torch.Tensor) -> list[dict]:
    N, K = w.shape
    auto = gemv_config(N, K, w.dtype)
    out = []
    timer.rebase()
    for bn, bk in [(16, 256), (32, 128), (32, 64), (64, 64), (64, 128), (128, 64)]:
        s_auto, _ = k_splits(N, K, bn, bk)
        k_tiles = triton.cdiv(K, bk)
        for want in sorted({1, s_auto, min(k_tiles, 2 * s_auto), max(1, s_auto // 2)}):
            s, _ = k_splits(N, K, bn, bk, want=want)
            for stages in (3, 4, 5):
                cfg = dict(block_n=bn, block_k=bk, splits=want, num_stages=stages)
                us = timer.cold_us(lambda cfg=cfg: small_m_linear(x, w, **cfg))
                out.append({"N": N, "K": K, "M": x.shape[0], "block_n": bn, "block_k": bk, "splits": s,
                            "num_stages": stages, "us": round(us, 2), "GBps": _gbps(N * K * 2, us),
                            "default": (bn, bk, s, stages) == (auto.block_n, auto.block_k, auto.splits,
                                                               auto.num_stages)})  # fmt: skip
    return out


def _rules(timer: Timer, dev: torch.device, shapes: dict, ms: list[int], rules: list[str]) -> dict:
    """Each rule "TARGET:MIN_SPLIT" (gemv_config's constants) applied to every shape: the configs it
    picks and the decode-step sum of calls x us at each M (configs shared by rules are timed once)."""
    timed: dict[tuple, float] = {}
    out: dict[str, dict] = {}
    for (N, K), entry in shapes.items():
        wt = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K**0.5
        timer.rebase()
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            for rule in rules:
                target, min_split = (int(v) for v in rule.split(":"))
                cfg = gemv_config(N, K, wt.dtype, target, min_split)
                key = (N, K, M, cfg)
                if key not in timed:
                    kw = dict(block_n=cfg.block_n, block_k=cfg.block_k, splits=cfg.splits)
                    timed[key] = timer.cold_us(lambda kw=kw, x=x, wt=wt: small_m_linear(x, wt, **kw))
                r = out.setdefault(rule, {}).setdefault(f"M={M}", {"step_us": 0.0, "shapes": []})
                r["step_us"] = round(r["step_us"] + entry["calls"] * timed[key], 2)
                r["shapes"].append({"N": N, "K": K, "calls": entry["calls"], "config": cfg._asdict(),
                                    "us": round(timed[key], 2)})  # fmt: skip
        print(f"# rules {N}x{K} done", file=sys.stderr)
        del wt
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32], help="row counts")
    ap.add_argument("--sweep", action="store_true", help="also sweep configurations per shape")
    ap.add_argument("--sweep-m", type=int, nargs="+", default=[1], help="row counts of the sweep")
    ap.add_argument("--rules", nargs="+", default=None, metavar="TARGET:MIN_SPLIT",
                    help="only compare split rules (gemv's TARGET_PROGRAMS:MIN_SPLIT_K_TILES)")  # fmt: skip
    ap.add_argument("--shapes", nargs="+", default=None, metavar="NxK", help="only these weight shapes")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    timer = Timer(dev)
    bw = copy_bandwidth(dev, 1 << 30)
    shapes: dict[tuple[int, int], dict] = {}
    for what, N, K, calls in SHAPES:
        if args.shapes and f"{N}x{K}" not in args.shapes:
            continue
        entry = shapes.setdefault((N, K), {"what": [], "calls": 0})
        entry["what"].append(what)
        entry["calls"] += calls
    if args.rules:
        out = {"benchmark": "small_m_gemm_rules", "git": git_info(None), "hardware": hardware(dev),
               "command": " ".join(["python", *sys.argv]), "copy_bandwidth": bw,
               "rules": _rules(timer, dev, shapes, args.m, args.rules)}  # fmt: skip
        print(json.dumps(out, indent=1))
        return
    rows, sweep = [], []
    for (N, K), entry in shapes.items():
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K**0.5
        for M in args.m:
            row = _row(timer, w, torch.randn(M, K, device=dev, dtype=torch.bfloat16))
            rows.append({"shape": " / ".join(entry["what"]), "calls_per_step": entry["calls"], **row})
            print(f"# {N}x{K} M={M}: new {row['new_us']} us, old {row['old_us']}, cublas {row['cublas_us']}",
                  file=sys.stderr)  # fmt: skip
        if args.sweep:
            for M in args.sweep_m:
                sweep += _sweep(timer, w, torch.randn(M, K, device=dev, dtype=torch.bfloat16))
        del w
        torch.cuda.empty_cache()
    step = {}
    for M in args.m:
        mine = [r for r in rows if r["M"] == M]
        nbytes = sum(r["calls_per_step"] * r["weight_bytes"] for r in mine)
        est = {
            k: round(sum(r["calls_per_step"] * r[f"{k}_us"] for r in mine), 1)
            for k in ("new", "old", "cublas")
        }
        step[f"M={M}"] = {
            "calls": sum(r["calls_per_step"] for r in mine), "weight_bytes": nbytes,
            "roofline_us_at_copy_bw": round(nbytes / (bw["GB_per_s"] * 1e3), 1),
            **{f"{k}_us": v for k, v in est.items()},
            **{f"{k}_GBps": _gbps(nbytes, v) for k, v in est.items()},
            "old_over_new": round(est["old"] / est["new"], 2) if est["new"] else None,
        }  # fmt: skip
    out = {"benchmark": "small_m_gemm", "git": git_info(None), "hardware": hardware(dev),
           "command": " ".join(["python", *sys.argv]), "dtype": "bfloat16",
           "timing": f"CUDA graph of {REPS} x [L2 flush, call] minus {REPS} x [L2 flush], median of "
                     f"{TRIALS} x {REPLAYS} replays (us_warm: {REPS} back-to-back calls, no flush)",
           "copy_bandwidth": bw, "decode_step_estimate": step, "rows": rows}  # fmt: skip
    if args.sweep:
        out["sweep"] = sweep
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
