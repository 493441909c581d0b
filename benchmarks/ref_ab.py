"""This tree against a previous one on the reference checkpoint and workload (nextserve_side.py), side by
side in one run: the two trees take turns (prev, this, prev, this, ...), one process a run, and every run's
JSON goes into one file (a device call returns few files). PREV is a copy of the previous tree, e.g.
`mkdir PREV && git archive REV | tar -x -C PREV` (its nextserve/assets may be left out).

    python benchmarks/ref_ab.py PREV OUT.json [--rounds 2] [--ckpt /tmp/ref8] [engine flags ...]

The checkpoint is made first when missing (benchmarks/reference/make_ckpt.py CKPT 8). Prints each run's
headline figures as it ends."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _env(tree: Path) -> dict:
    """The environment with `tree`'s package first on the path."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))


def _side(tree: Path, ckpt: str, flags: list[str]) -> dict:
    """One nextserve_side.py run from `tree`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "side.json"
        cmd = [sys.executable, "benchmarks/nextserve_side.py", ckpt, str(out), *flags]
        subprocess.run(cmd, cwd=tree, env=_env(tree), check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def headline(res: dict) -> dict:
    """The figures compared with vLLM: prefill tok/s, agent turns' TTFT, decode tok/s."""
    keys = ("engine_init_s", "prefill_1024_tok_s", "prefill_8192_tok_s", "peak_device_gib")
    out = {k: res.get(k) for k in keys}
    out["agent_ttft_s"] = {str(t["turn"]): t["ttft_s"] for t in res.get("agent", [])}
    out["decode_tok_s"] = {c: res[c]["decode_tok_s"] for c in ("c1", "c8", "c32") if c in res}
    return out


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)  # every other --flag is the engine's
    p.add_argument("prev", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ckpt", default="/tmp/ref8")
    args, flags = p.parse_known_args()
    if not (Path(args.ckpt) / "config.json").exists():
        make = [sys.executable, "benchmarks/reference/make_ckpt.py", args.ckpt, "8"]
        subprocess.run(make, cwd=ROOT, env=_env(ROOT), check=True)
    runs: dict = {}
    for r in range(1, args.rounds + 1):
        for name, tree in (("prev", args.prev.resolve()), ("this", ROOT)):
            runs[f"{name}_{r}"] = _side(tree, args.ckpt, flags)
            print(f"{name}_{r}", json.dumps(headline(runs[f"{name}_{r}"])), flush=True)
            args.out.write_text(json.dumps({"flags": flags, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
