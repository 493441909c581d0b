"""Does fetching a projection's weight into L2 on a side stream, while the latency-bound kernels before it
run, shorten a decode step? A c1 decode step is a chain of small kernels (norms, hyper-connection mixes,
recurrences) that leave HBM idle, then projections that stream their weights from HBM. This measures, per
(gap, projection) pair in a CUDA graph:

- `gap`: the latency-bound chain alone (GAP x the Triton G-norm on one [1, 10240] row, PDL on);
- `gemv`: the projection alone (the engine's row-invariant GEMV, M = 1);
- `serial`: gap then projection, as the engine runs them;
- `prefetch_<kind>_<frac>`: the same, with a side stream that, when the gap starts, fetches the first
  `frac` of the projection's weight into L2 (kinds: `line` = one `prefetch.global.L2::evict_last` per
  128-byte line; `bulk` = `cp.async.bulk.prefetch.L2` of 16 KiB chunks, sm_90).

Each graph runs the pair over COPIES distinct weights (3x the L2 or more in all), so no weight is in L2
from the previous pair. us per pair = replay time / COPIES, the median replay of
nextserve.bench.timing.graph_us (BENCHMARKS.md's figures were taken with the script at 94444ff, which timed
7 x 5 replays by CUDA events, the median). Prints one JSON object; run on a CUDA machine:
python benchmarks/bench_l2_prefetch.py
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from nextserve.bench import copy_bandwidth, git_info, hardware
from nextserve.bench.timing import graph_us
from nextserve.ops.norms import rms_norm
from nextserve.ops.pdl import pdl_mode
from nextserve.ops.triton.gemv import small_m_linear

SHAPES = [  # (what, N, K)
    ("GDN/QSA out 2560x6144", 2560, 6144),
    ("GDN in_proj 16480x2560", 16480, 2560),
    ("HC down|inject 324x10240", 324, 10240),
    ("HC up 10240x320", 10240, 320),
]
L2_BYTES = 50 * 2**20
LINE, CHUNK = 128, 16384


@triton.jit
def _prefetch(ptr, dummy_ptr, n_bytes, BLOCK: tl.constexpr, STEP: tl.constexpr, BULK: tl.constexpr):
    """Each element fetches STEP bytes at its offset into L2: one line (BULK False) or one bulk copy."""
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * STEP
    offs = tl.minimum(offs, n_bytes - STEP)  # n_bytes is a multiple of STEP here
    if BULK:
        r = tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], 16384;\n\tmov.u32 $0, 0;",
            "=r,l", [ptr + offs], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        r = tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
            "=r,l", [ptr + offs], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    tl.store(dummy_ptr + tl.program_id(0), tl.sum(r))


def prefetch(kind: str, w: torch.Tensor, frac: float, dummy: torch.Tensor) -> None:
    flat = w.view(-1).view(torch.uint8)
    n = int(flat.numel() * frac) // CHUNK * CHUNK
    bulk = kind == "bulk"
    step, block = (CHUNK, 32) if bulk else (LINE, 1024)
    grid = (triton.cdiv(n // step, block),)
    _prefetch[grid](flat, dummy, n, BLOCK=block, STEP=step, BULK=bulk, num_warps=1 if bulk else 4)


def bench_shape(N: int, K: int, gap: int, fracs: list[float], kinds: list[str]) -> dict:
    dev = torch.device("cuda")
    nbytes = N * K * 2
    copies = max(4, -(-3 * L2_BYTES // nbytes))
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    row = torch.randn(1, 10240, device=dev, dtype=torch.bfloat16)
    nw = torch.zeros(10240, device=dev, dtype=torch.bfloat16)
    dummy = torch.zeros(1 << 16, device=dev, dtype=torch.int32)
    side = torch.cuda.Stream()

    def chain():
        h = row
        for _ in range(gap):
            h = rms_norm(h, nw, 1e-6, group=2560)
        return h

    def serial(kind: str | None = None, frac: float = 0.0):
        def run():
            main = torch.cuda.current_stream()
            for w in ws:
                if kind is not None:
                    side.wait_stream(main)  # the gap starts: fetch the projection's weight meanwhile
                    with torch.cuda.stream(side):
                        prefetch(kind, w, frac, dummy)
                chain()
                small_m_linear(x, w)
            if kind is not None:
                main.wait_stream(side)

        return run

    res = {"copies": copies, "weight_mb": round(nbytes / 1e6, 2)}
    with pdl_mode(True):
        res["gap"] = graph_us(lambda: [chain() for _ in ws]) / copies
        res["gemv"] = graph_us(lambda: [small_m_linear(x, w) for w in ws]) / copies
        res["serial"] = graph_us(serial()) / copies
        for kind in kinds:
            for frac in fracs:
                res[f"prefetch_{kind}_{frac}"] = graph_us(serial(kind, frac)) / copies
        ref = small_m_linear(x, ws[0])
        torch.cuda.synchronize()
    res = {k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}
    with pdl_mode(True):
        g = torch.cuda.CUDAGraph()
        out = torch.empty_like(ref)
        with torch.cuda.graph(g):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                prefetch("bulk", ws[0], 1.0, dummy)
            chain()
            out.copy_(small_m_linear(x, ws[0]))
            torch.cuda.current_stream().wait_stream(side)
        g.replay()
        torch.cuda.synchronize()
        res["equal_bits"] = bool(torch.equal(out, ref))
    ws.clear()
    torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gap", type=int, nargs="+", default=[4, 8], help="small kernels before each projection")
    p.add_argument("--fracs", type=float, nargs="+", default=[0.5, 1.0])
    p.add_argument("--kinds", nargs="+", default=["line", "bulk"], choices=["line", "bulk"])
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    out = {
        "git": git_info(),
        "hardware": hardware(dev),
        "command": " ".join(["python benchmarks/bench_l2_prefetch.py", *(argv or sys.argv[1:])]),
        "copy_bandwidth": copy_bandwidth(dev, 1 << 30),
        "runs": [],
    }
    for what, N, K in SHAPES:
        for gap in args.gap:
            r = bench_shape(N, K, gap, args.fracs, args.kinds)
            out["runs"].append({"shape": what, "gap_kernels": gap, **r})
            print(json.dumps(out["runs"][-1]), file=sys.stderr)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
