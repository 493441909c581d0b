"""Where a Triton launch's host time goes: the host us a call (GPU held by a sleep kernel, so nothing
waits on the device) of one rms_norm launch at a prefill chunk's shape, through
- `wrapper`: ops/norms.rms_norm, as the model calls it (checks, reshape, torch.empty, the launch);
- `jit`: the `_rms_norm[grid](...)` launch alone (Triton's binder, specialisation, cache key, launcher);
- `launcher`: the compiled kernel's launcher alone, replaying the exact arguments Triton passed it
  (recorded from one `jit` launch), i.e. the floor any cheaper launch path in Python could reach;
and for scale a torch elementwise op and `torch.empty`. Prints JSON; on a CUDA machine:

    python benchmarks/bench_launch.py [--tokens 1024] [--rounds 5] [--calls 500]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.ops.norms import rms_norm  # noqa: E402
from nextserve.ops.triton import norms  # noqa: E402
from nextserve.ops.triton.common import pdl_args  # noqa: E402

SLEEP_CYCLES = 2_000_000_000  # ~1 s at 1.98 GHz: longer than any loop below queues


def host_us(fn, calls: int) -> float:
    """Host us a call of fn, the GPU held so no call waits for the device."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) * 1e6 / calls
    torch.cuda.synchronize()
    return us


def recorded_launcher(jit_launch):
    """(launch, args): the compiled kernel's launcher and the arguments one `jit_launch()` passed it."""
    kernel = jit_launch()  # JITFunction.run returns the compiled kernel it launched
    seen: list = []
    cls = type(kernel)
    run_attr = cls.__dict__["run"]  # a property in some Triton versions, a method in others
    run = run_attr.__get__(kernel, cls)
    cls.run = property(lambda self: lambda *a, **k: seen.append((a, k)) or run(*a, **k))
    try:
        jit_launch()
    finally:
        cls.run = run_attr
    ((args, kwargs),) = seen
    return lambda: run(*args, **kwargs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=500)
    args = p.parse_args()
    x = torch.randn(args.tokens, 2560, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2560, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    S = x.shape[0]

    def jit():
        return norms._rms_norm[(triton.cdiv(S, 1),)](
            x, w, x, y, S, 1, 2560, 1, x.stride(0), 0, x.stride(0), 0, 1.0 / 2560, 1e-6,
            ROWS=1, BLOCK=4096, GATED=False, SIGMOID=False, ROUND_PROD=False, num_warps=16, **pdl_args(x),
        )  # fmt: skip

    ops = {
        "wrapper": lambda: rms_norm(x, w, 1e-6),
        "jit": jit,
        "launcher": recorded_launcher(jit),
        "torch_add": lambda: torch.add(x, x, out=y),
        "torch_empty": lambda: torch.empty((S, 2560), device="cuda", dtype=torch.bfloat16),
    }
    out = {"benchmark": "launch", "git": git_info(None), "hardware": hardware("cuda"),
           "triton": triton.__version__, "command": " ".join(["python", *sys.argv]),
           "host_us_a_call": {}}  # fmt: skip
    for op in ops.values():
        op()  # compile, plan
    for name, op in ops.items():
        times = [host_us(op, args.calls) for _ in range(args.rounds)]
        out["host_us_a_call"][name] = {"median": round(statistics.median(times), 2),
                                       "all": [round(t, 2) for t in times]}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
