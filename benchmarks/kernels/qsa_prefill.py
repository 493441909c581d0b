"""QSA prefill of one chunk at the real Flash-Next sizes, a 62,700-token prompt's last full 4,096-token
chunk (positions 57,344 .. 61,439): per-call microseconds of the indexer scores, the selection and the
attention, through the decode kernels row by row (the previous build's path: an expanded block table,
the attention in 32 splits and a combine) and through the prefill path (ops/attention.py
prefill_index_scores, prefill_sparse_attention), the attention at other tiles and warp counts. Prints
JSON; run on a CUDA machine: python benchmarks/bench_kernels.py qsa_prefill"""

from __future__ import annotations

import json
import sys

import torch
import triton.testing

from kernels import parse_no_flags
from nextserve.bench import git_info, hardware
from nextserve.ops.attention import (
    index_scores,
    paged_sparse_attention,
    prefill_index_scores,
    prefill_sparse_attention,
    select_decode_tokens,
)
from nextserve.ops.triton.qsa_decode import triton_paged_sparse_attention

NQ, NKV, D, NI, DI, C, TOPK, PAGE = 24, 2, 256, 4, 128, 4, 512, 64
START, T = 57344, 4096
VARIANTS = [(32, 4), (64, 4), (16, 4), (32, 8), (64, 8)]  # (tile, num_warps) of the one-split attention


def _us(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median") * 1e3


def main() -> None:
    parse_no_flags(__doc__)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n_pages = -(-(START + T) // PAGE)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev).bfloat16()

    k_plane, v_plane = rnd(n_pages + 8, PAGE, NKV, D), rnd(n_pages + 8, PAGE, NKV, D)
    key_plane = rnd(n_pages + 8, PAGE // C, DI)
    table = torch.randperm(n_pages + 8, generator=g, device=dev)[:n_pages].to(torch.int32)
    q, q_idx = rnd(T, NQ, D), rnd(T, NI, DI)
    pos = torch.arange(START, START + T, device=dev)
    n_blocks = (pos + 1) // C
    scaling = D**-0.5

    def old_scores():
        wide = table[None].expand(T, -1).contiguous()  # the previous build's KVView.rows copy
        return index_scores(q_idx, key_plane, wide, n_blocks, n_pages * (PAGE // C)), wide

    def new_scores():
        return prefill_index_scores(q_idx, key_plane, table, START, C)[0]

    scores, wide = old_scores()
    tokens = select_decode_tokens(scores, n_blocks, pos, C, TOPK)
    new = new_scores()
    new_tokens = select_decode_tokens(new, n_blocks, pos, C, TOPK)
    res = {
        "chunk": {"start": START, "rows": T},
        "sizes": dict(nq=NQ, nkv=NKV, d=D, ni=NI, di=DI, c=C, topk=TOPK),
    }
    res["selection_rows_equal"] = int((tokens == new_tokens).all(dim=1).sum())
    res["us"] = {
        "scores_decode_kernel_with_table_copy": _us(old_scores),
        "scores_prefill_kernel": _us(new_scores),
        "select_decode_width": _us(lambda: select_decode_tokens(scores, n_blocks, pos, C, TOPK)),
        "select_prefill_width": _us(lambda: select_decode_tokens(new, n_blocks, pos, C, TOPK)),
        "attention_decode_32_splits": _us(
            lambda: paged_sparse_attention(q, k_plane, v_plane, wide, tokens, scaling)
        ),
        "attention_prefill": _us(
            lambda: prefill_sparse_attention(q, k_plane, v_plane, table, tokens, scaling)
        ),
    }
    row = table[None].expand(T, -1)
    for tile, warps in VARIANTS:
        res["us"][f"attention_one_split_tile{tile}_warps{warps}"] = _us(
            lambda tile=tile, warps=warps: triton_paged_sparse_attention(
                q, k_plane, v_plane, row, tokens, scaling, tile=tile, num_splits=1, num_warps=warps
            )
        )
    kv_bytes = int((tokens >= 0).sum()) * NKV * D * 2 * 2  # every row's selected K and V, read once
    res["attention_prefill_tb_per_s"] = kv_bytes / (res["us"]["attention_prefill"] * 1e-6) / 1e12
    res["us"] = {k: round(v, 1) for k, v in res["us"].items()}
    print(
        json.dumps(
            {"revision": git_info(), "hardware": hardware(dev), "command": " ".join(sys.argv)} | res, indent=1
        )
    )


if __name__ == "__main__":
    main()
