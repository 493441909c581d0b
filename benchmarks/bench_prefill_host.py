"""Whether a prefill chunk is bound by the host or by the GPU: one engine over random 8-layer flash-next
weights (bf16, prefix reuse off), prompts of CHUNK + 1 tokens at --prefill-chunk CHUNK, so the first
step runs one whole chunk and samples nothing. That step is queued while a sleep kernel holds the GPU:
`host_ms` is how long engine.step() took to return (the host's cost of the chunk: scheduling, Python,
launches), `device_ms` the GPU time from the sleep's end to the chunk's end (its kernels back to back).
A chunk whose host_ms exceeds its device_ms leaves the GPU idle. Each GDN path takes turns (ops/gdn.py
FLA_MIN_TOKENS: below the chunk = fla's chunked kernels, above = the token-by-token kernel). Also the GDN
call alone (one layer's shapes): host and device time of fla's entry and of the token-by-token kernel;
and the host us a call of a cuBLAS GEMM, an RMS norm (the model's call, its Triton launch alone, the
launcher alone) and torch ops. --cprofile adds the host's top functions (us a call) of one chunk and of
PROFILED_CALLS GDN calls on each path. Prints JSON; on a CUDA machine:

    python benchmarks/bench_prefill_host.py [--chunks 1024 2048] [--rounds 5] [--cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nextserve.bench.model import bench_config, engine_for_model, random_flash_next  # noqa: E402
from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.engine.sampling import SamplingParams  # noqa: E402
from nextserve.ops import gdn  # noqa: E402

SLEEP_CYCLES = 400_000_000  # ~0.2 s at 1.98 GHz: longer than any 8-layer chunk's host time measured here
MODES = {"token_by_token": 1 << 30, "fla": 64}  # FLA_MIN_TOKENS of each GDN path
PROFILED_CALLS = 20  # GDN calls under --cprofile (their mean per call is reported)


def _held(fn) -> tuple[float, float]:
    """(host ms of fn, device ms of what it queued) with the GPU held by a sleep kernel while fn runs."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    t = time.perf_counter()
    fn()
    host = (time.perf_counter() - t) * 1e3
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end)


def chunk_times(engine, chunk: int, rounds: int, profile: bool, seed: int) -> dict:
    """Per GDN path: median host_ms and device_ms of a prompt's first whole chunk; with `profile` the
    top host functions of one more chunk."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    default_threshold = gdn.FLA_MIN_TOKENS  # restored at the end
    gen = torch.Generator().manual_seed(seed)
    vocab = min(9000, engine.model_config.vocab_size)
    res: dict = {}
    for r in range(rounds + 1 + profile):  # round 0 warms both paths
        prompt = torch.randint(10, vocab, (chunk + 1,), generator=gen).tolist()
        for mode, threshold in MODES.items():
            gdn.FLA_MIN_TOKENS = threshold
            engine.add_request(prompt, params)
            prof = cProfile.Profile() if profile and r == rounds + 1 else None
            step = prof.runcall if prof else (lambda f: f())
            host, device = _held(lambda step=step: step(engine.step))
            while engine.has_unfinished():
                engine.step()
            if prof:
                res[mode] |= _top_functions(prof)
            elif r:
                res.setdefault(mode, {"host_ms": [], "device_ms": []})
                res[mode]["host_ms"].append(round(host, 3))
                res[mode]["device_ms"].append(round(device, 3))
    for row in res.values():
        row["host_ms_median"] = statistics.median(row["host_ms"])
        row["device_ms_median"] = statistics.median(row["device_ms"])
    gdn.FLA_MIN_TOKENS = default_threshold
    return res


def _top_functions(prof: cProfile.Profile, per: int = 1, n: int = 25) -> dict:
    """The n functions of a profile with the most time of their own, and with the most in all, as rows of
    microseconds per profiled call (`per` calls ran under the profile; pstats' own print rounds to ms)."""
    rows = [
        {"function": pstats.func_std_string(fn), "calls": nc / per, "tottime_us": tt / per * 1e6,
         "cumtime_us": ct / per * 1e6}
        for fn, (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()
    ]  # fmt: skip
    res = {}
    for key in ("tottime_us", "cumtime_us"):
        top = sorted(rows, key=lambda r: -r[key])[:n]
        res[f"cprofile_top_{key}"] = [{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}
                                      for r in top]  # fmt: skip
    return res


def gdn_call_times(T: int, rounds: int, profile: bool) -> dict:
    """One GDN layer's call at T tokens (Flash-Next: 16 key heads, 48 value heads, 128 wide): host and
    device ms of fla's entry (as ops/gdn.py calls it) and of the token-by-token kernel; with `profile`
    the host's top functions over PROFILED_CALLS more calls of each, per call."""
    from nextserve.ops.triton.gdn_chunk import triton_gated_delta_rule

    g = torch.Generator(device="cuda").manual_seed(T)
    q, k = (torch.randn(T, 16, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(T, 48, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    decay = -torch.rand(T, 48, device="cuda", generator=g).to(torch.bfloat16)
    beta = torch.rand(T, 48, device="cuda", generator=g).to(torch.bfloat16)
    state = torch.zeros(48, 128, 128, device="cuda")
    out = {}
    paths = (
        ("fla", gdn.fla_gated_delta_rule),
        ("token_by_token", triton_gated_delta_rule),
    )
    for name, fn in paths:
        fn(q, k, v, decay, beta, state)  # compile
        times = [_held(lambda fn=fn: fn(q, k, v, decay, beta, state)) for _ in range(rounds)]
        out[name] = {"host_ms": statistics.median(h for h, _ in times),
                     "device_ms": statistics.median(d for _, d in times)}  # fmt: skip
        if profile:
            prof = cProfile.Profile()
            for _ in range(PROFILED_CALLS):  # µs of a call need many calls: a call's parts are a few µs
                _held(lambda fn=fn, prof=prof: prof.runcall(fn, q, k, v, decay, beta, state))
            out[name] |= _top_functions(prof, per=PROFILED_CALLS)
    return out


def _recorded_launcher(jit_launch):
    """The compiled kernel's launcher, replaying the arguments one `jit_launch()` passed it."""
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


def call_costs(T: int, rounds: int, calls: int = 200) -> dict:
    """Host us a call (GPU held) of the things a prefill forward does most: a cuBLAS GEMM at the GDN
    in-projection's shape; an RMS norm as the model calls it (ops/norms.py: checks, views, an allocation,
    the launch), its Triton launch alone (`_rms_norm[grid](...)`: binder, cache key, checks, launcher) and
    the compiled kernel's launcher alone (the arguments Triton passed it, replayed: the floor of any
    launch path in Python); a torch elementwise op and a torch allocation."""
    from nextserve.ops.norms import rms_norm
    from nextserve.ops.triton import norms
    from nextserve.ops.triton.common import pdl_args

    x = torch.randn(T, 2560, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    w = torch.randn(16480, 2560, device="cuda", dtype=torch.bfloat16)
    nw = torch.ones(2560, device="cuda", dtype=torch.bfloat16)

    def triton_launch():
        return norms._rms_norm[(T,)](
            x, nw, x, y, T, 1, 2560, 1, x.stride(0), 0, x.stride(0), 0, 1.0 / 2560, 1e-6,
            ROWS=1, BLOCK=4096, GATED=False, SIGMOID=False, ROUND_PROD=False, num_warps=16, **pdl_args(x),
        )  # fmt: skip

    ops = {
        "cublas_linear": lambda: torch.nn.functional.linear(x, w),
        "triton_rms_norm": lambda: rms_norm(x, nw, 1e-6),
        "triton_launch": triton_launch,
        "triton_launcher_alone": _recorded_launcher(triton_launch),
        "torch_add": lambda: torch.add(x, x, out=y),
        "torch_empty": lambda: torch.empty((T, 2560), device="cuda", dtype=torch.bfloat16),
    }
    out = {}
    for name, op in ops.items():
        op()  # compile, plan
        per_call = [_held(lambda op=op: [op() for _ in range(calls)])[0] * 1e3 / calls for _ in range(rounds)]
        out[name] = round(statistics.median(per_call), 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cprofile", action="store_true")
    args = p.parse_args()
    assert gdn._fla_chunk() is not None, "flash-linear-attention is not installed"
    cfg, _ = bench_config("flash-next", 8, None)
    model = random_flash_next(cfg, "cuda", torch.bfloat16, seed=0)
    out = {"benchmark": "prefill_host", "git": git_info(None), "hardware": hardware("cuda"),
           "command": " ".join(["python", *sys.argv]), "chunks": {}, "gdn_call": {},
           "host_us_a_call": {}}  # fmt: skip
    for chunk in args.chunks:
        engine = engine_for_model(
            model, torch.device("cuda"), torch.bfloat16, max_context=chunk + 64, prefix_cache=False,
            prefill_chunk=chunk, max_concurrency=1, prefill_batch_chunks=1,
        )  # fmt: skip
        out["chunks"][chunk] = chunk_times(engine, chunk, args.rounds, args.cprofile, seed=chunk)
        out["gdn_call"][chunk] = gdn_call_times(chunk, args.rounds, args.cprofile)
        out["host_us_a_call"][chunk] = call_costs(chunk, args.rounds)
        del engine
        torch.cuda.empty_cache()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
