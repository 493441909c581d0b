"""Batched QSA decode ops over the paged KV cache (index_scores, select_decode_tokens,
paged_sparse_attention) at the real Flash-Next sizes, every row at a 32K context, B = 1, 8, 32:
per-call microseconds of each op, of the attention kernel at other tilings, of the three in one CUDA
graph, and of the per-row torch references on the same GPU. Prints JSON; run on a CUDA machine:
python benchmarks/bench_kernels.py qsa_decode"""

from __future__ import annotations

import json
import sys

import torch
import triton.testing

from kernels import parse_no_flags
from nextserve.bench import git_info, hardware
from nextserve.ops.attention import (
    _index_scores_reference,
    _paged_sparse_attention_reference,
    index_scores,
    paged_sparse_attention,
    select_decode_tokens,
)
from nextserve.ops.triton.qsa_decode import triton_paged_sparse_attention

NQ, NKV, D, NI, DI, C, TOPK, PAGE = 24, 2, 256, 4, 128, 4, 512, 64
CONTEXT = 32768
BATCHES = (1, 8, 32)
TILINGS = [(32, 32), (64, 16), (64, 32), (32, 16), (32, 64), (16, 64)]  # (tile, num_splits); default first


def _us(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median") * 1e3


def _graph_us(fn) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _us(graph.replay)


def _row(B: int, k_plane, v_plane, key_plane, table, g) -> dict:
    dev, dt = k_plane.device, k_plane.dtype
    max_blocks = table.shape[1] * (PAGE // C)
    scaling = D**-0.5
    q = torch.randn(B, NQ, D, device=dev, dtype=dt, generator=g)
    q_idx = torch.randn(B, NI, DI, device=dev, dtype=dt, generator=g)
    positions = torch.full((B,), CONTEXT - 1, device=dev, dtype=torch.int64)
    n_blocks = (positions + 1) // C
    scores = index_scores(q_idx, key_plane, table, n_blocks, max_blocks)
    tokens = select_decode_tokens(scores, n_blocks, positions, C, TOPK)

    def step():
        s = index_scores(q_idx, key_plane, table, n_blocks, max_blocks)
        t = select_decode_tokens(s, n_blocks, positions, C, TOPK)
        return paged_sparse_attention(q, k_plane, v_plane, table, t, scaling)

    def reference():
        s = _index_scores_reference(q_idx, key_plane, table, n_blocks, max_blocks)
        t = select_decode_tokens(s, n_blocks, positions, C, TOPK)
        return _paged_sparse_attention_reference(q, k_plane, v_plane, table, t, scaling)

    row = {"B": B, "context": CONTEXT, "tokens_per_row": tokens.shape[1], "max_blocks": max_blocks}
    row["index_scores_us"] = _us(lambda: index_scores(q_idx, key_plane, table, n_blocks, max_blocks))
    row["select_decode_tokens_us"] = _us(lambda: select_decode_tokens(scores, n_blocks, positions, C, TOPK))
    row["paged_sparse_attention_us"] = _us(
        lambda: paged_sparse_attention(q, k_plane, v_plane, table, tokens, scaling)
    )
    for tile, splits in TILINGS:
        row[f"attention_tile{tile}_splits{splits}_us"] = _us(
            lambda tile=tile, splits=splits: triton_paged_sparse_attention(
                q, k_plane, v_plane, table, tokens, scaling, tile=tile, num_splits=splits
            )
        )
    row["three_ops_eager_us"] = _us(step)
    row["three_ops_graph_us"] = _graph_us(step)
    row["torch_reference_us"] = _us(reference)
    kv_bytes = B * tokens.shape[1] * NKV * D * 2 * 2
    row["attention_kv_bytes"] = kv_bytes
    row["attention_GBps"] = kv_bytes / row["paged_sparse_attention_us"] / 1e3
    row["index_key_bytes"] = B * max_blocks * DI * 2
    row["index_scores_GBps"] = row["index_key_bytes"] / row["index_scores_us"] / 1e3
    return row


def main() -> None:
    parse_no_flags(__doc__)
    dev = torch.device("cuda")
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    B_max = max(BATCHES)
    pages_per_row = CONTEXT // PAGE
    total = B_max * pages_per_row + 1
    k_plane = torch.randn(total, PAGE, NKV, D, device=dev, dtype=dt, generator=g)
    v_plane = torch.randn(total, PAGE, NKV, D, device=dev, dtype=dt, generator=g)
    key_plane = torch.randn(total, PAGE // C, DI, device=dev, dtype=dt, generator=g)
    perm = torch.randperm(total - 1, device=dev, generator=g).to(torch.int32)
    table_all = perm.view(B_max, pages_per_row)
    rows = [_row(B, k_plane, v_plane, key_plane, table_all[:B].contiguous(), g) for B in BATCHES]
    out = {"benchmark": "qsa_decode", "git": git_info(None), "hardware": hardware(dev),
           "command": " ".join(["python", *sys.argv]), "rows": rows}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
