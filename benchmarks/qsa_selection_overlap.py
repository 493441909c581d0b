"""How much consecutive prefill rows' QSA selections overlap: a cold prefill of a long prompt on random
flash-next weights, each prefill attention call's token lists hooked, and the mean union of the selected
tokens over G consecutive rows (against G times one row's count when they are disjoint).

    OUT=dir python benchmarks/qsa_selection_overlap.py [--layers 8] [--length 62700]

Writes $OUT/overlap.json (one row per call: rows, list width, valid tokens a row, union_G) and prints the
last four rows. A tile of query rows sharing its K/V gathers pays only where unions stay near one row's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nextserve.model.qsa as qsa  # noqa: E402
from nextserve.bench.model import bench_config, engine_for_model, random_flash_next  # noqa: E402
from nextserve.engine.sampling import SamplingParams  # noqa: E402

GROUPS = (2, 4, 8, 16, 64)


def _stats(tokens: torch.Tensor) -> dict:
    t = tokens.long()
    T, width = t.shape
    row = {"rows": T, "list": width, "valid_mean": float((t >= 0).sum(1).float().mean())}
    for g in GROUPS:
        n = (T // g) * g
        s, _ = t[:n].view(n // g, g * width).sort(dim=1)
        uniq = ((s[:, 1:] != s[:, :-1]) & (s[:, 1:] >= 0)).sum(1) + (s[:, 0] >= 0).long()
        row[f"union_{g}"] = float(uniq.float().mean())
    row["max_tok"] = int(t.max())
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--length", type=int, default=62700)
    p.add_argument("--chunk", type=int, default=4096)
    args = p.parse_args()
    dev = torch.device("cuda")
    cfg, _ = bench_config("flash-next", args.layers)
    model = random_flash_next(cfg, dev, torch.bfloat16, seed=0)
    prompt = torch.randint(3, cfg.vocab_size, (args.length,), generator=torch.Generator().manual_seed(0))
    engine = engine_for_model(
        model, dev, torch.bfloat16, max_concurrency=1, max_context=args.length + 64,
        prefill_chunk=args.chunk, prefix_cache=False, warm_up=False,
    )  # fmt: skip
    stats = []
    attend = qsa.prefill_sparse_attention

    def hooked(q, k, v, table, tokens, scaling):
        stats.append(_stats(tokens))
        return attend(q, k, v, table, tokens, scaling)

    qsa.prefill_sparse_attention = hooked
    engine.add_request(prompt.tolist(), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    with open(os.path.join(os.environ.get("OUT", "."), "overlap.json"), "w") as f:
        json.dump(stats, f, indent=0)
    for row in stats[-4:]:
        print(row)


if __name__ == "__main__":
    main()
