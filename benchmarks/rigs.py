"""The seed's rigs played on one machine: one stage process per card, all on one device, each capped at its
card's memory, activations through host memory (no peer access), a table per pipeline mode.

    python benchmarks/rigs.py --model /tmp/ref8 --layout A --device cuda --dtype bfloat16
    python benchmarks/rigs.py --layout B --long 96 160      # the default model on the CPU, scaled down

Layouts: A, four RTX 3060 (12 GB) and a TITAN RTX (24 GB, the 16-layer stage), layers 8,8,8,8,16 of 48; B, two
RTX 3060, a TITAN RTX and an RTX 3090 (12, 12, 24, 24 GB), layers 8,8,17,15 (the seed ran B with an 8-bit KV
cache: `--kv-dtype int8`, an engine flag here). A model of fewer layers gets the same number of stages, each
with its share of the layers (rounded, at least one, the largest stage taking what rounding left). Each
stage's cap is its own weights plus the room the real card keeps after the released model's (48 layers)
weights of that stage, both in --quantization's format (int4 by default: the released model is 63 GiB in int4,
the only format both layouts' 72 GB hold), without the n-gram table with --ple-table host (and the routed
experts with --experts host): the stage is as tight for KV, state slots and headroom as the real card would
be. A layout whose real card cannot hold its stage's weights in that format is refused, naming the card. On
the CPU the caps are only printed (a CPU has no per-process cap). Any further `--name value` is an engine flag
of every engine (EngineConfig field, dashes for underscores), e.g. `--memory-headroom-mib 512` as such a rig
needs. On one H100, layout A's first stage does not fit with its experts on the card (BENCHMARKS.md, Pipeline
stages); `--experts host --expert-cache-gib G` is the way.

Modes, each against one process decoding the same greedy requests: serial (one chunk in flight, one decode
group), pipelined prefill (a step's chunks in flight on every stage), decode groups (two groups in flight),
pipeline windows (MTP drafts, the front stages running the guessed next window; needs mtp.* weights). For
each: outputs equal to one process's (n of n, token ids), decode tok/s at 1 and 4 requests (short prompts,
--tokens each: the wall of a whole generate), TTFT of each --long prompt, and J/token of the 4-request run
(NVML; none on the CPU). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nextserve_side import engine_flags  # noqa: E402

from nextserve import LLM, SamplingParams  # noqa: E402
from nextserve.bench.meters import EnergyMeter  # noqa: E402
from nextserve.bench.model import bench_config, fp8_held, int4_held  # noqa: E402
from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.config import ModelConfig  # noqa: E402
from nextserve.engine.memory_plan import tensor_bytes, weight_kind  # noqa: E402
from nextserve.engine_config import DEFAULT_MODEL  # noqa: E402
from nextserve.model.loader import INT4_GROUP, model_fp8_capable  # noqa: E402
from nextserve.model.shapes import expected_shapes  # noqa: E402
from nextserve.runtime.pipeline import in_stage  # noqa: E402

LAYOUTS = {  # (layers of the released model per stage, each card's GiB)
    "A": ([8, 8, 8, 8, 16], [12, 12, 12, 12, 24]),
    "B": ([8, 8, 17, 15], [12, 12, 24, 24]),
}
RELEASED_LAYERS = 48
MODES = {
    "serial": dict(pipeline_prefill_chunks=1),
    "pipelined prefill": dict(pipeline_prefill_chunks="auto"),
    "decode groups": dict(decode_groups=2),
    "pipeline windows": dict(speculative_method="mtp", speculative_tokens=3, pipeline_windows=True),
}


def scaled_layers(real: list[int], layers: int) -> list[int]:
    """Each stage's share of `layers`, as `real` splits RELEASED_LAYERS (rounded, at least one each)."""
    assert layers >= len(real), f"{layers} layers cannot fill {len(real)} stages"
    split = [max(1, round(r * layers / RELEASED_LAYERS)) for r in real]
    split[split.index(max(split))] += layers - sum(split)
    assert min(split) >= 1 and sum(split) == layers, split
    return split


def stage_weight_bytes(
    cfg: ModelConfig, split: list[int], quantization: str, host_kinds: frozenset[str] = frozenset()
) -> list[int]:
    """Bytes of each stage's weights on its card (its layers; the first the embeddings, the last the head) as
    `--quantization` of a 16-bit checkpoint holds them (memory_plan.tensor_bytes of the loader's choice:
    bench.model's fp8_held and int4_held), without the kinds (memory_plan.weight_kind: "PLE", "experts")
    held in host memory."""
    shapes = expected_shapes(cfg, with_mtp=False)
    capable = model_fp8_capable(cfg, False)
    fp8 = fp8_held(capable, cfg) if quantization == "fp8" else set()
    held = int4_held(capable, shapes) if quantization == "int4" else set()
    int4 = {n: (INT4_GROUP, torch.bfloat16, True) for n in held}
    sizes = tensor_bytes(shapes, fp8, torch.bfloat16, int4)
    bounds = [0, *itertools.accumulate(split)]
    return [
        sum(
            b
            for n, b in sizes.items()
            if in_stage(n, range(lo, hi), cfg) and weight_kind(n) not in host_kinds
        )
        for lo, hi in zip(bounds, bounds[1:], strict=False)
    ]


def scaled_caps(
    cfg: ModelConfig, layout: str, quantization: str, host_kinds: frozenset[str] = frozenset()
) -> tuple[list[int], list[float]]:
    """(this model's stage layers, each stage's GiB as the module docstring says). SystemExit where a real
    card cannot hold the released model's stage in this format."""
    real_split, gib = LAYOUTS[layout]
    split = scaled_layers(real_split, cfg.num_hidden_layers)
    released, _ = bench_config("flash-next", layers=RELEASED_LAYERS)
    ours = stage_weight_bytes(cfg, split, quantization, host_kinds)
    theirs = stage_weight_bytes(released, real_split, quantization, host_kinds)
    caps = []
    for card, (g, a, b) in enumerate(zip(gib, ours, theirs, strict=True)):
        room = g * 2**30 - b
        if room <= 0:
            raise SystemExit(
                f"layout {layout}: card {card} ({g} GB) cannot hold the released model's {real_split[card]} "
                f"layers in --quantization {quantization} ({b / 2**30:.1f} GiB of weights): try int4, or "
                "--experts host"
            )
        caps.append(round((a + room) / 2**30, 4))
    return split, caps


def measure(llm: LLM, want: list[list[int]], prompts: list[list[int]], args, device: str) -> dict:
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, greedy)]
    row = {"outputs_equal": f"{sum(a == b for a, b in zip(got, want, strict=True))} of {len(want)}"}
    meter = EnergyMeter(torch.device(device))
    for n in (1, 4):
        mj = meter.read_mj()
        t0 = time.perf_counter()
        llm.generate(prompts[:n], greedy)
        wall = time.perf_counter() - t0
        row[f"decode_{n}_tok_per_s"] = round(n * args.tokens / wall, 2)
        end = meter.read_mj()
        if n == 4:
            joules = None if mj is None or end is None else (end - mj) / 1e3
            row["J_per_token_4"] = None if joules is None else round(joules / (4 * args.tokens), 4)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    for length in args.long:
        prompt = torch.randint(100, 2000, (length,), generator=g).tolist()
        t0 = time.perf_counter()
        llm.generate([prompt], first)
        row[f"ttft_{length}_s"] = round(time.perf_counter() - t0, 4)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="A")
    ap.add_argument("--device", default="cpu", help="cpu, or one cuda device every stage shares")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens a request")
    ap.add_argument("--long", type=int, nargs="*", default=[33000, 62700], help="prompts timed to 1st token")
    ap.add_argument(
        "--quantization",
        choices=["none", "fp8", "int4"],
        default="int4",
        help="the weights' format, of the caps and every engine (default: int4)",
    )
    ap.add_argument(
        "--ple-table",
        choices=["device", "host"],
        default="host",
        help="where the n-gram table lives, in the caps and every engine (default: host)",
    )
    ap.add_argument(
        "--experts",
        choices=["device", "host"],
        default="device",
        help="where the routed experts live, in the caps and every engine (host: each stage reads them over "
        "the bus, with an --expert-cache-gib of its own if given; default: device)",
    )
    ap.add_argument("--revision", default=None, help="record this git revision (a tree copied without .git)")
    args, rest = ap.parse_known_args()
    cfg = ModelConfig.from_dir(args.model)
    host_kinds = frozenset({"PLE"} if args.ple_table == "host" else ()) | (
        {"experts"} if args.experts == "host" else set()
    )
    split, caps = scaled_caps(cfg, args.layout, args.quantization, host_kinds)
    stages = len(split)
    cuda = args.device.startswith("cuda")
    index = (torch.device(args.device).index or 0) if cuda else 0
    flags = dict(device=args.device, dtype=args.dtype, max_concurrency=4, skip_tokenizer=True,
                 max_context=max([*args.long, 256]) + args.tokens + 64, quantization=args.quantization,
                 ple_table=args.ple_table, experts=args.experts) | engine_flags(rest)  # fmt: skip
    stage_flags = dict(pipeline_stages=stages, stage_layers=",".join(map(str, split)), stage_transport="host",
                       pipeline_devices=",".join([str(index)] * stages) if cuda else None)  # fmt: skip
    if cuda:
        stage_flags["stage_memory_gib"] = ",".join(map(str, caps))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 2000, (24 + 8 * i,), generator=g).tolist() for i in range(4)]
    one = LLM(args.model, **flags)
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in one.generate(prompts, greedy)]
    table = {"one process": measure(one, want, prompts, args, args.device)}
    one.close()
    for mode in args.modes:
        try:
            llm = LLM(args.model, **flags, **stage_flags, **MODES[mode])
        except Exception as exc:  # noqa: BLE001 - a mode the model cannot run is reported, not fatal
            table[mode] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        try:
            table[mode] = measure(llm, want, prompts, args, args.device)
        finally:
            llm.close()
    out = {"benchmark": "rigs", "git": git_info(args.revision), "hardware": hardware(args.device),
           "command": " ".join(["python", *sys.argv]), "layout": args.layout, "stage_layers": split,
           "stage_memory_gib": caps, "caps_applied": cuda, "quantization": args.quantization,
           "ple_table": args.ple_table, "experts": args.experts, "engine_flags": engine_flags(rest),
           "kv": flags.get("kv_dtype", "auto"), "modes": table}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
