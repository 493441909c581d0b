"""A plain `pip install nextserve` (no extras: no Triton, no server packages) imports and generates on the
CPU. CI also runs `nextserve generate` in a fresh virtual environment without extras (.ci/run)."""

from __future__ import annotations

import subprocess
import sys

BLOCKED = (
    "triton",
    "xgrammar",
    "fastapi",
    "uvicorn",
    "starlette",
    "pydantic",
    "prometheus_client",
    "jsonschema",
)

SCRIPT = f"""
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: not a base dependency)")
        return None

sys.meta_path.insert(0, Block())
from nextserve import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", dtype="float32", max_concurrency=1, cpu_kv_budget_mib=16)
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
assert len(out.token_ids) == 3, out
print("generated", out.token_ids)
"""


def test_the_engine_runs_without_optional_packages(tiny_model_dir):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "generated" in r.stdout
