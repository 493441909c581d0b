"""The run: the command line, the order of the phases under the time budget, and the JSON it writes."""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..cache.kv_pool import kv_bytes_per_token
from ..config import DTYPES
from ..engine_config import EngineConfig
from . import __doc__ as _package_doc
from .hf import hf_decode, hf_prefill, hf_run, transformers_model
from .meters import EnergyMeter, copy_bandwidth, host_link_bandwidth, sync
from .model import bench_config, engine_for_model, random_flash_next
from .profile import profile_decode_step
from .provenance import git_info, hardware
from .report import ratios, summary
from .roofline import roofline
from .workload import decode_max_tokens, ns_decode, ns_prefill, random_prompt


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset", default="flash-next",
        help="make-model preset of the random weights: tiny, small, flash-next (default: flash-next; "
        "on a CPU try --preset small --device cpu --concurrency 1 --no-transformers)",
    )  # fmt: skip
    p.add_argument(
        "--layers", type=int, default=None, metavar="N", help="decoder layers (default: the preset's)"
    )
    p.add_argument(
        "--ngram-vocab-base",
        type=int,
        default=None,
        metavar="B",
        help="PLE ngram_vocab_size_base (default: the preset's)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    p.add_argument(
        "--dtype", default="auto",
        help="auto (bfloat16 on cuda, float32 on cpu), bfloat16, float16, float32 or float64 (default: auto)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts (default: 0)")
    p.add_argument(
        "--prompt-lens", type=int, nargs="+", default=[1024], metavar="L",
        help="prefill prompt lengths (default: 1024; agents send 60K: try 1024 8192 62000)",
    )  # fmt: skip
    p.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 8, 32], metavar="B",
        help="requests decoding at once, one run each (default: 1 8 32)",
    )  # fmt: skip
    p.add_argument(
        "--decode-steps", type=int, default=6, help="timed decode steps per concurrency (default: 6)"
    )
    p.add_argument(
        "--decode-prompt-len", type=int, default=256,
        help="prompt tokens of each decoding request (default: 256)",
    )  # fmt: skip
    # NOTE: the engine's own defaults, so a bench measures what `nextserve serve` runs
    chunk, page = EngineConfig.prefill_chunk, EngineConfig.page_size
    p.add_argument(
        "--prefill-chunk", type=int, default=chunk, help=f"engine prefill chunk (default: {chunk})"
    )
    p.add_argument("--page-size", type=int, default=page, help=f"engine KV page size (default: {page})")
    p.add_argument(
        "--transformers", action=argparse.BooleanOptionalAction, default=True,
        help="also run the workload through transformers' Qwen4ExpForCausalLM (default: on)",
    )  # fmt: skip
    p.add_argument(
        "--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
        help="replay nextserve's decode steps as CUDA graphs (the engine's --cuda-graph; default: on)",
    )  # fmt: skip
    p.add_argument(
        "--pdl", action=argparse.BooleanOptionalAction, default=True,
        help="programmatic dependent launch of nextserve's kernels (the engine's --pdl; default: on)",
    )  # fmt: skip
    p.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
        help="launch each decode step before reading the previous one's tokens (the engine's flag; "
        "default: on)",
    )  # fmt: skip
    p.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="profile one decode step (default: on)",
    )
    p.add_argument(
        "--copy-mib", type=int, default=None, help="copy-bandwidth buffer (default 4096 on cuda, 64 cpu)"
    )
    p.add_argument(
        "--budget-s", type=float, default=300.0,
        help="prompt lengths beyond the first are skipped once the run would pass this many seconds "
        "(default: 300)",
    )  # fmt: skip
    p.add_argument(
        "--quantization", choices=["none", "fp8", "int4"], default="none",
        help="fp8: the projections and experts block-wise FP8, read by the FP8 kernels; int4: W4A16 in "
        "groups of 128, read by the int4 kernels (default: none)",
    )  # fmt: skip
    p.add_argument(
        "--ple-table", choices=["device", "host"], default="device",
        help="where the n-gram table lives: device, or pinned host memory (default: device)",
    )  # fmt: skip
    p.add_argument(
        "--experts", choices=["device", "host"], default="device",
        help="where the routed experts live: device, or pinned host memory read over the bus, with a device "
        "expert cache of --expert-cache-gib (default: device)",
    )  # fmt: skip
    p.add_argument(
        "--expert-cache-gib", default="auto",
        help="the engine's --expert-cache-gib with --experts host: GiB, 0 or auto (default: auto)",
    )  # fmt: skip
    p.add_argument(
        "--kv-dtype", choices=["auto", "int8", "fp8"], default="auto",
        help="the engine's --kv-dtype: the model dtype, or 8-bit codes (int8, or fp8: E4M3) with a float32 "
        "scale a vector (default: auto)",
    )  # fmt: skip
    p.add_argument(
        "--gpu-memory-gib", type=float, default=None,
        help="the engine's --gpu-memory-gib: act as if the GPU had this many GiB (default: its own)",
    )  # fmt: skip
    p.add_argument(
        "--router-skew", type=float, default=0.0,
        help="skew the random routers as trained ones are: each layer's router row of the expert ranked r "
        "(a random order) scaled by (r + 1) ** -A, renormalised (a wider logit lands in the top-k more "
        "often); 0: uniform routing (default: 0)",
    )  # fmt: skip
    p.add_argument(
        "--revision", default=None, help="git revision to record when the tree has no .git (default: none)"
    )
    p.add_argument(
        "--out", default=None, help="also write the JSON here, rewritten after every phase (default: none)"
    )


class _Run:
    def __init__(self, args: argparse.Namespace, command: str) -> None:
        self.args, self.t0 = args, time.perf_counter()
        self.result: dict[str, Any] = {
            "benchmark": "nextserve_bench",  # + the device it ran on, set when it is known
            "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "command": command,
            "git": git_info(args.revision),
            "skipped": [],
        }

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def save(self) -> None:
        self.result["elapsed_s"] = round(self.elapsed(), 1)
        if self.args.out:
            Path(self.args.out).write_text(json.dumps(self.result, indent=2) + "\n")

    def fits(self, what: str, estimate_s: float) -> bool:
        if self.elapsed() + estimate_s <= self.args.budget_s:
            return True
        self.result["skipped"].append(
            f"{what}: estimated {estimate_s:.0f} s at {self.elapsed():.0f} s elapsed, "
            f"budget {self.args.budget_s:.0f} s"
        )
        log(f"skip {what} (time budget)")
        return False


def _free(device: torch.device) -> None:
    gc.collect()  # engines hold reference cycles; their pools and the 45 GB of weights must go now
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The whole benchmark; returns the JSON object (also written to --out after every phase).

    Order: copy bandwidth; nextserve prefill at the first prompt length, decode at every concurrency, the
    profile; transformers the same; then the longer prompt lengths, each only if the time budget allows."""
    run = _Run(args, command)
    res = run.result
    device = EngineConfig(model=".", device=args.device).torch_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    res["benchmark"] = f"nextserve_bench_{device.type}"
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = DTYPES[args.dtype]
    cfg, raw = bench_config(args.preset, args.layers, args.ngram_vocab_base)
    res["hardware"] = hardware(device)
    meter = EnergyMeter(device)
    res["energy_counter"] = "nvmlDeviceGetTotalEnergyConsumption" if meter.handle is not None else meter.error

    # The memory ceiling: device copy bandwidth, measured first, with nothing else on the device.
    copy_mib = args.copy_mib or (4096 if device.type == "cuda" else 64)
    res["copy_bandwidth"] = bw = copy_bandwidth(device, copy_mib * 2**20)
    bandwidth = bw["bytes_moved"] / bw["median_s"]
    log(f"copy bandwidth {bw['GB_per_s']} GB/s")

    steps, dplen = args.decode_steps, args.decode_prompt_len
    warm_len = min(128, dplen)  # warm-up prompts: both paths' shapes and allocations before timing
    max_conc = max(args.concurrency)
    # Room for every request's prompt + max_tokens at once, so no step preempts; prefix reuse off (random
    # prompts share no prefix: images would only hold pages).
    per_request = dplen + decode_max_tokens(max_conc, dplen, args.prefill_chunk, steps) + args.page_size
    capacity = max(max(args.prompt_lens) + 8, max_conc * per_request, 256)
    capacity = -(-capacity // args.page_size) * args.page_size
    engine_flags = dict(
        prefill_chunk=args.prefill_chunk, max_concurrency=max_conc, kv_capacity=capacity,
        max_context=capacity, page_size=args.page_size, max_pending=max(256, max_conc),
        cuda_graph=args.cuda_graph, pdl=args.pdl, async_scheduling=args.async_scheduling, prefix_cache=False,
        gpu_memory_gib=args.gpu_memory_gib, kv_dtype=args.kv_dtype,
    )  # fmt: skip
    if args.experts == "host":
        gib = args.expert_cache_gib
        engine_flags |= dict(experts="host", expert_cache_gib=gib if gib == "auto" else float(gib))
        res["host_link"] = host_link_bandwidth(device, 1 << 30)

    def nextserve_engine():
        t = time.perf_counter()
        model = random_flash_next(
            cfg,
            device,
            dtype,
            args.seed,
            fp8=args.quantization == "fp8",
            ple_host=args.ple_table == "host",
            int4=args.quantization == "int4",
            experts_host=args.experts == "host",
            router_skew=args.router_skew,
        )
        sync(device)
        built = time.perf_counter() - t
        engine = engine_for_model(model, device, dtype, **engine_flags)
        log(f"nextserve model built in {built:.1f} s; warm-up")
        # NOTE: at most max_concurrency warm-up requests: a waiting one would not decode every step
        ns_decode(engine, [random_prompt(rng, V, warm_len) for _ in range(min(2, max_conc))], 2, meter)
        return model, engine, built

    rng = torch.Generator().manual_seed(args.seed + 1)
    V = cfg.vocab_size
    lengths = list(dict.fromkeys(args.prompt_lens))
    prefill_prompts = {L: random_prompt(rng, V, L) for L in lengths}
    decode_prompts = {B: [random_prompt(rng, V, dplen) for _ in range(B)] for B in args.concurrency}

    model, engine, built = nextserve_engine()
    fp8 = frozenset(n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn)
    int4 = frozenset(n for n, p in model.named_parameters() if p.dtype == torch.int32)
    host = frozenset(n for n, p in model.named_parameters() if p.device.type != device.type)  # pinned
    if device.type == "cuda":  # what is left for KV once the weights, slots and graphs are in
        free, total = torch.cuda.mem_get_info(device)
        per_seq = 65536 * kv_bytes_per_token(cfg, len(cfg.qsa_layers) + 1, dtype, args.kv_dtype)
        res["memory_after_build"] = {
            "free_bytes": free, "total_bytes": total,
            "sequences_of_64k_tokens_in_the_free_memory_less_2_GiB": max(0, (free - 2 * 2**30) // per_seq),
        }  # fmt: skip
    res["model"] = {
        "preset": args.preset,
        "num_hidden_layers": cfg.num_hidden_layers,
        "layer_types": list(cfg.layer_types),
        "ple_layer_ids": list(cfg.ple_layer_ids),
        "ngram_vocab_size_base": cfg.ngram_vocab_size_base,
        "hidden_size": cfg.hidden_size,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "vocab_size": cfg.vocab_size,
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in model.parameters()),
        "weight_bytes": sum(
            p.numel() * p.element_size() for n, p in model.named_parameters() if n not in host
        ),
        "host_weight_bytes": sum(
            p.numel() * p.element_size() for n, p in model.named_parameters() if n in host
        ),
        "quantization": args.quantization,
        "ple_table": args.ple_table,
        "experts": args.experts,
        "router_skew": args.router_skew,
        "fp8_tensors": len(fp8),
        "int4_tensors": len(int4),
        "build_s": round(built, 2),
        "weights": "random, drawn on the device by nextserve.bench.random_flash_next (no checkpoint)",
    }
    res["engine"] = {
        **engine_flags,
        "path": "LLMEngine.step(): Scheduler.schedule -> ModelRunner.execute -> update (what LLM.generate "
        "runs); on CUDA the Triton kernels of nextserve/ops/triton, row-invariant decode, decode steps "
        + ("replayed as CUDA graphs" if args.cuda_graph else "run eagerly (--no-cuda-graph)"),
    }
    ns: dict[str, Any] = {"prefill": [], "decode": []}
    res["nextserve"] = ns
    log(f"nextserve prefill {lengths[0]}")
    ns_prefill(engine, random_prompt(rng, V, lengths[0]), meter)  # warm-up: kernels JIT for these shapes
    ns["prefill"].append(ns_prefill(engine, prefill_prompts[lengths[0]], meter))
    run.save()
    for B in args.concurrency:
        log(f"nextserve decode concurrency {B}")
        r = ns_decode(engine, decode_prompts[B], steps, meter)
        link = res.get("host_link", {}).get("GB_per_s")
        cache = r["expert_cache"]
        if cache is not None and link and cache["link_bytes_per_token"]:  # the rate the link allows
            cache["link_bound_tok_per_s"] = round(link * 1e9 / cache["link_bytes_per_token"], 2)
            cache["fraction_of_link_bound"] = round(r["decode_tok_per_s"] / cache["link_bound_tok_per_s"], 4)
        r["roofline"] = roofline(cfg, B, round(r["mean_context"]), bandwidth, fp8, host, int4)
        r["roofline_fraction"] = round(r["decode_tok_per_s"] / r["roofline"]["tok_per_s"], 5)
        ns["decode"].append(r)
        run.save()
    if args.profile:
        log("nextserve profile of one decode step")
        ns["profile_decode_c1"] = profile_decode_step(engine, random_prompt(rng, V, dplen), meter)
        run.save()
    del engine
    _free(device)

    hf_res: dict[str, Any] = {"ran": False}
    res["transformers"] = hf_res
    hf = None
    if args.transformers:
        log("transformers: Qwen4ExpForCausalLM with the same weights")
        try:
            t = time.perf_counter()
            hf, info = transformers_model(raw, model, device, dtype)
            hf_res |= info | {"build_s": round(time.perf_counter() - t, 2)}
        except Exception as exc:  # noqa: BLE001 - say why rather than fake it
            hf_res["reason"] = f"{type(exc).__name__}: {exc}"
            log(f"transformers cannot run: {hf_res['reason']}")
    else:
        hf_res["reason"] = "not asked (--no-transformers)"
    del model
    _free(device)
    if hf is not None:
        hf_res |= {"ran": True, "prefill": [], "decode": []}
        try:
            log("transformers warm-up")
            hf_run(hf, [random_prompt(rng, V, warm_len) for _ in range(2)], 2, device, meter)
            log(f"transformers prefill {lengths[0]}")
            hf_prefill(hf, random_prompt(rng, V, lengths[0]), device, meter)  # warm-up, as nextserve's
            hf_res["prefill"].append(hf_prefill(hf, prefill_prompts[lengths[0]], device, meter))
            run.save()
            for B in args.concurrency:
                log(f"transformers decode concurrency {B}")
                r = hf_decode(hf, decode_prompts[B], steps, device, meter)
                ceiling = roofline(cfg, B, dplen + 1 + steps // 2, bandwidth)["tok_per_s"]
                r["roofline_fraction"] = round(r["decode_tok_per_s"] / ceiling, 5)
                hf_res["decode"].append(r)
                run.save()
        except Exception as exc:  # noqa: BLE001
            hf_res["error"] = f"{type(exc).__name__}: {exc}"
            log(f"transformers failed: {hf_res['error']}")
        _free(device)

    # Longer prompts last, each only if the budget allows (estimated from the first length, linear for
    # nextserve's kernels and the warm-up prefill, with margin for transformers' quadratic attention masks).
    if hf is not None and hf_res.get("prefill") and "error" not in hf_res:
        hf_per_token = hf_res["prefill"][0]["ttft_s"] / lengths[0]
        for L in lengths[1:]:
            if not run.fits(f"transformers prefill {L}", hf_per_token * L * 3):
                continue
            log(f"transformers prefill {L}")
            try:
                hf_res["prefill"].append(hf_prefill(hf, prefill_prompts[L], device, meter))
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory at a long prompt
                hf_res["prefill"].append({"prompt_len": L, "error": f"{type(exc).__name__}: {exc}"})
            _free(device)
            run.save()
    del hf
    _free(device)
    ns_per_token = ns["prefill"][0]["ttft_s"] / lengths[0]
    fitting = [L for L in lengths[1:] if run.fits(f"nextserve prefill {L}", ns_per_token * L * 3 + 2 * built)]
    if fitting:
        model, engine, _ = nextserve_engine()
        for L in fitting:
            if L != fitting[0] and not run.fits(f"nextserve prefill {L}", ns_per_token * L * 3):
                continue
            log(f"nextserve prefill {L}")
            ns_prefill(engine, random_prompt(rng, V, L), meter)  # warm-up at this length
            r = ns_prefill(engine, prefill_prompts[L], meter)
            ns_per_token = max(ns_per_token, r["ttft_s"] / L)
            ns["prefill"].append(r)
            run.save()
        del engine, model
        _free(device)

    res["ratios_nextserve_over_transformers"] = ratios(ns, hf_res)
    res["notes"] = [
        "nextserve runs its Triton kernels on CUDA; decode is row-invariant and, unless --no-cuda-graph, "
        "replayed as CUDA graphs.",
        "prefill: one request, max_tokens 1; TTFT = add_request to first token, after one untimed prefill "
        "of another random prompt of the same length (nextserve at every length, transformers at the "
        "first), so Triton's JIT compiles are not timed; nextserve prefills in chunks of prefill_chunk, "
        "transformers in one forward over the whole prompt.",
        "decode: all requests prefilled first (the scheduler's own mix), then decode_steps timed steps in "
        "which every request decodes one token; greedy, ignore_eos; random-token prompts.",
        "transformers: the same weights and prompts; greedy with its DynamicCache, one forward per token "
        "for the whole batch (generate's loop without its bookkeeping).",
        "roofline: bytes_per_step / copy bandwidth; decode_step_bytes in nextserve/bench/roofline.py says "
        "what is counted.",
    ]
    run.save()
    return res


def main(argv: list[str] | None = None, prog: str = "nextserve bench") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=_package_doc.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_from_args(args, shlex.join([prog, *(sys.argv[1:] if argv is None else argv)]))


def run_from_args(args: argparse.Namespace, command: str | None = None) -> int:
    """Runs the benchmark and prints its JSON on stdout (progress goes to stderr)."""
    res = run(args, command or shlex.join(sys.argv))
    print(json.dumps(res, indent=2))
    print(summary(res), file=sys.stderr)
    return 0
