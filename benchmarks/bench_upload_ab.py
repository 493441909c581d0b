"""Host-to-device copies of a step's inputs queued through page-locked memory (`ops/pinned.upload`)
against torch's blocking copy from pageable memory (which waits for every queued kernel), side by side in
one process: one engine over random 8-layer flash-next weights (bf16, prefix reuse off), the two copy modes
taking turns on the same prompts. Prints the median TTFT of each prompt length in each mode as JSON; run on
a CUDA machine:

    python benchmarks/bench_upload_ab.py [--lengths 1024 16384] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nextserve.bench.model import bench_config, engine_for_model, random_flash_next  # noqa: E402
from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.bench.timing import ttft_by_mode  # noqa: E402
from nextserve.ops.pinned import upload  # noqa: E402


def blocking_upload(values, dtype: torch.dtype, device) -> torch.Tensor:
    """The copy before `upload`: torch.tensor onto the device (blocking from pageable memory)."""
    return torch.tensor(values, dtype=dtype, device=device)


def use(fn) -> None:
    """Every loaded nextserve module that copies a step's inputs through `upload` copies them with fn."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("nextserve.") and getattr(mod, "upload", None) in (upload, blocking_upload):
            mod.upload = fn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 16384])
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    cfg, _ = bench_config("flash-next", 8, None)
    model = random_flash_next(cfg, "cuda", torch.bfloat16, seed=0)
    engine = engine_for_model(
        model, torch.device("cuda"), torch.bfloat16, max_context=max(args.lengths) + 64, prefix_cache=False
    )
    modes = {"queued": lambda: use(upload), "blocking": lambda: use(blocking_upload)}
    rows = ttft_by_mode(engine, modes, args.lengths, args.rounds, seed=11)
    use(upload)
    out = {"benchmark": "upload_ab", "git": git_info(None), "hardware": hardware("cuda"),
           "rounds": args.rounds, "rows": rows}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
