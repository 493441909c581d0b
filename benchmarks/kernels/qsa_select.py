"""The QSA block selection (`ops/triton/qsa_select.py`) at prefill and decode shapes: its configuration
(`SelectTiles`: tiles, radix width, warps) searched one field at a time from the decode defaults
(coordinate descent, two rounds), then DECODE_TILES against PREFILL_TILES at row counts in between (which
one `select_tiles` picks is set by PREFILL_ROWS). Each shape's scores are the indexer's prefill scores of
random bf16 queries and block keys at the real Flash-Next sizes (a 4,096-row chunk at the given start;
fewer rows: the chunk's last ones). Every configuration's output is checked equal to the defaults' (the
kernel's contract: the configuration changes the speed only). Prints JSON; run on a CUDA machine:
python benchmarks/bench_kernels.py qsa_select [--starts 57344 12288] [--no-search]"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import torch
import triton.testing

from nextserve.bench import git_info, hardware
from nextserve.ops.attention import prefill_index_scores
from nextserve.ops.triton.qsa_select import (
    DECODE_TILES,
    PREFILL_TILES,
    SelectTiles,
    triton_select_decode_tokens,
)

NI, DI, C, TOPK, PAGE, T = 4, 128, 4, 512, 64, 4096
SPACE = {
    "radix_bits": [4, 5, 6, 7, 8],
    "num_warps": [2, 4, 8, 16, 32],
    "tile_r": [2048, 4096, 8192, 16384],
    "tile_s": [256, 512, 1024, 2048, 4096, 8192],
    "tile_small": [128, 256, 512, 1024, 2048],
}


def _chunk_scores(start: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores [T, M], n_blocks [T], positions [T]) of the chunk at positions start .. start+T-1."""
    dev = torch.device("cuda")
    n_pages = -(-(start + T) // PAGE)
    key_plane = torch.randn(n_pages + 8, PAGE // C, DI, generator=g, device=dev).bfloat16()
    table = torch.randperm(n_pages + 8, generator=g, device=dev)[:n_pages].to(torch.int32)
    q_idx = torch.randn(T, NI, DI, generator=g, device=dev).bfloat16()
    scores, n_blocks = prefill_index_scores(q_idx, key_plane, table, start, C)
    return scores, n_blocks, torch.arange(start, start + T, device=dev)


def _timer(scores, n_blocks, pos):
    """us(tiles): median microseconds of one call, after checking its tokens equal DECODE_TILES'."""
    want = triton_select_decode_tokens(scores, n_blocks, pos, C, TOPK, DECODE_TILES)

    def us(tiles: SelectTiles) -> float:
        got = triton_select_decode_tokens(scores, n_blocks, pos, C, TOPK, tiles)
        assert torch.equal(got, want), f"{tiles} changed the selection"
        fn = lambda: triton_select_decode_tokens(scores, n_blocks, pos, C, TOPK, tiles)  # noqa: E731
        return triton.testing.do_bench(fn, return_mode="median") * 1e3

    return us


def _search(scores, n_blocks, pos) -> dict:
    """Coordinate descent from DECODE_TILES: each field over its SPACE, the others at the best so far."""
    us, timed = _timer(scores, n_blocks, pos), {}

    def cost(cfg: dict) -> float:
        key = json.dumps(cfg, sort_keys=True)
        if key not in timed:
            timed[key] = us(SelectTiles(**cfg))
        return timed[key]

    start = asdict(DECODE_TILES)
    best = dict(start)
    for _ in range(2):
        for name, values in SPACE.items():
            trials = {v: cost(best | {name: v}) for v in values}
            best[name] = min(trials, key=trials.get)
    return {
        "decode_tiles_us": round(cost(start), 1),
        "best": best,
        "best_us": round(cost(best), 1),
        "tried": {k: round(v, 1) for k, v in sorted(timed.items(), key=lambda kv: kv[1])},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, nargs="+", default=[57344, 12288])
    ap.add_argument("--decode-rows", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--compare-rows", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--no-search", action="store_true", help="only DECODE_TILES against PREFILL_TILES")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    res: dict = {"decode_tiles": asdict(DECODE_TILES), "prefill_tiles": asdict(PREFILL_TILES)}
    for start in args.starts:
        scores, n_blocks, pos = _chunk_scores(start, g)
        if not args.no_search:
            res[f"prefill_rows{T}_start{start}"] = _search(scores, n_blocks, pos)
            if start == max(args.starts):
                for b in args.decode_rows:
                    sl = slice(T - b, T)
                    res[f"decode_rows{b}_start{start + T - b}"] = _search(scores[sl], n_blocks[sl], pos[sl])
        for b in args.compare_rows:
            us = _timer(scores[T - b :], n_blocks[T - b :], pos[T - b :])
            res[f"compare_rows{b}_start{start + T - b}"] = {
                "decode_tiles_us": round(us(DECODE_TILES), 1),
                "prefill_tiles_us": round(us(PREFILL_TILES), 1),
            }
    head = {"revision": git_info(), "hardware": hardware("cuda"), "command": " ".join(sys.argv)}
    print(json.dumps(head | res, indent=1))


if __name__ == "__main__":
    main()
