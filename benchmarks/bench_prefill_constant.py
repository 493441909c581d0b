"""Cold prefill TTFT with a kernel module's constant at each value in turn: one engine over random 8-layer
flash-next weights (bf16, or --quantization fp8 / int4; prefix reuse off: every prompt cold), the values
taking turns within every round on the same prompts (`nextserve.bench.timing.ttft_by_mode`). Prints the
median TTFT (s) and prefill tok/s of each prompt length under each value as JSON; run on a CUDA machine:

    python benchmarks/bench_prefill_constant.py --constant nextserve.ops.triton.conv_chunk:ROWS \\
        --values 32 0 [--lengths 8192 62700] [--rounds 3]

A value is a Python literal (ast.literal_eval). The constant must be read at launch time (a module global
the launcher reads on every call), as the tile and warp constants of ops/triton are.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nextserve.bench.model import bench_config, engine_for_model, random_flash_next  # noqa: E402
from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.bench.timing import ttft_by_mode  # noqa: E402


def ttft_by_value(
    module, name: str, values: list, lengths: list[int], rounds: int, layers: int = 8, label: str = "",
    quantization: str = "none",
) -> list[dict]:  # fmt: skip
    """ttft_by_mode's rows with module.<name> set to each value in turn (modes named "<label>=<value>")."""
    cfg, _ = bench_config("flash-next", layers, None)
    forms = {"fp8": quantization == "fp8", "int4": quantization == "int4"}
    model = random_flash_next(cfg, "cuda", torch.bfloat16, seed=0, **forms)
    engine = engine_for_model(
        model, torch.device("cuda"), torch.bfloat16, max_context=max(lengths) + 64, prefix_cache=False
    )
    modes = {f"{label or name}={v!r}": lambda v=v: setattr(module, name, v) for v in values}
    return ttft_by_mode(engine, modes, lengths, rounds, seed=7)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--constant", required=True, help="module:NAME")
    p.add_argument("--values", nargs="+", required=True)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 62700])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--quantization", choices=["none", "fp8", "int4"], default="none")
    p.add_argument("--revision", default=None, help="record this git revision (a tree copied without .git)")
    args = p.parse_args()
    mod_name, name = args.constant.split(":")
    mod = importlib.import_module(mod_name)
    assert hasattr(mod, name), f"{mod_name} has no {name}"
    values = [ast.literal_eval(v) for v in args.values]
    rows = ttft_by_value(
        mod, name, values, args.lengths, args.rounds, args.layers, quantization=args.quantization
    )
    out = {"benchmark": "prefill_constant", "constant": args.constant, "git": git_info(args.revision)}
    out["quantization"] = args.quantization
    out |= {"hardware": hardware("cuda"), "layers": args.layers, "rounds": args.rounds, "rows": rows}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
