#!/usr/bin/env python3
"""MTP draft acceptance of a model directory (default: the packaged default model) on held-out stdlib
files, with nextserve's own inference model (FlashNext + MTP via loader.load_weights).

For each held-out file: its first --prompt-tokens tokens are the prompt, the target generates
--new-tokens greedy tokens (serial reference: prefill in chunks, then one token per forward), and at each
generated position the MTP proposes a greedy chain of 4 drafts. Width w accepts the longest prefix of
the first w drafts that equals the target's own greedy tokens. Also prints the held-out validation loss
and the target's CPU decode tokens/s. Prints JSON (git revision, hardware, command)."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nextserve.train import data  # noqa: E402
from nextserve.train.evaluate import acceptance, greedy_with_drafts, load, summarize, validation_loss  # noqa: E402


def default_model_dir() -> Path:
    from importlib.resources import files

    return Path(str(files("nextserve") / "assets" / "default_model"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--files", type=int, default=6, help="held-out files (prompts)")
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--val-windows", type=int, default=6)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model_dir = Path(a.model) if a.model else default_model_dir()
    t = time.perf_counter()
    cfg, model, mtp = load(model_dir)
    load_s = time.perf_counter() - t
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    _, held = data.split_files()
    held = [(r, x) for r, x in held if len(x) > 4000]
    eot = tok.token_to_id("<|endoftext|>")
    val_ids, _ = data.encode_stream(tok, [x for _, x in held], eot)
    val = validation_loss(model, val_ids, 512, a.val_windows)
    gens, drafts, per_tok = [], [], []
    for _, text in held[: a.files]:
        prompt = tok.encode(text).ids[: a.prompt_tokens]
        g, d, s = greedy_with_drafts(model, mtp, prompt, a.new_tokens, 4)
        gens.append(g)
        drafts.append(d)
        per_tok.append(s)
    widths = {}
    for w in range(1, 5):
        widths[str(w)] = summarize([acceptance(g, d, w) for g, d in zip(gens, drafts, strict=True)])
    rev = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = bool(
        subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    )
    out = {
        "benchmark": "mtp_acceptance",
        "git_revision": rev + ("-dirty" if dirty else ""),
        "hardware": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": str(model_dir),
        "load_s": round(load_s, 3),
        "heldout_files": [r for r, _ in held[: a.files]],
        "validation": val,
        "cpu_decode_tokens_per_s": round(len(per_tok) / sum(per_tok), 2),  # target alone, 1 token/forward
        "acceptance": widths,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
