#!/usr/bin/env python3
"""Train nextserve's embedded default model on the running interpreter's standard library.

    python tools/train_default_model.py --device cuda --out DIR            # ~10 minutes on one H200
    python tools/train_default_model.py --smoke --out DIR                  # a CPU, a couple of minutes
    python tools/train_default_model.py --device cuda --steps N --out DIR  # reproduce a run exactly

The directory written is a Hugging Face model directory (config.json, model.safetensors in bf16,
tokenizer, generation_config.json, training_log.json); the shipped one lives in
nextserve/assets/default_model/."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))
if "nextserve" not in sys.modules:
    # NOTE: training needs only nextserve.config/model/ops/train; skipping the package __init__ (which
    # imports the serving engine) keeps this script independent of the server's own dependencies.
    import types

    _pkg = types.ModuleType("nextserve")
    _pkg.__path__ = [str(_ROOT / "nextserve")]
    sys.modules["nextserve"] = _pkg

from nextserve.train.trainer import train  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="model directory to write")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="toy setting for a CPU in a couple of minutes")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: about --minutes)")
    p.add_argument("--minutes", type=float, default=9.0, help="training time when --steps is not given")
    a = p.parse_args(argv)
    steps = a.steps if a.steps is not None else (60 if a.smoke else None)
    s = train(Path(a.out), "smoke" if a.smoke else "default", a.device, a.seed, steps, a.minutes)
    print(json.dumps({k: v for k, v in s.items() if k != "history"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
