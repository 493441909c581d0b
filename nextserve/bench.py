"""`nextserve bench`: the GPU baseline of issue 6, and the yardstick every later kernel is measured with.

One run, one JSON object (git revision, hardware, command):
- prefill tok/s and TTFT at each prompt length (one request through the engine: chunked prefill, then the
  first token), and decode tok/s at each concurrency (random-token prompts, greedy, ignore_eos), both
  through the engine's scheduler and runner, i.e. what `LLM.generate` runs;
- peak memory (torch.cuda.max_memory_allocated) and J/token from NVML's energy counter;
- the memory-bandwidth roofline: the bytes one decode step must move (counted from the config, see
  `decode_step_bytes`) over the device copy bandwidth measured in the same run;
- the same workload through transformers' Qwen4ExpForCausalLM with the same weights, when it imports and
  runs (otherwise the JSON says why);
- a short profile of one decode step at concurrency 1 (time per module kind, top ops, launches).

The model's weights are drawn on the device (`random_flash_next`): no checkpoint is read or written.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .config import DTYPES, EngineConfig, ModelConfig
from .model.flash_next import FlashNext
from .model.loader import expected_shapes
from .model.make_model import _init, _seed_for, preset_overrides, text_config

BENCH_EOS = 2  # make-model's <|im_end|> id; prompts are drawn from ids >= FIRST_PROMPT_ID, so never eos
FIRST_PROMPT_ID = 8
# Untimed decode steps at each concurrency before the timed ones: the first step at a new batch size pays
# one-off costs (on the H200 run of 2026-11-30, transformers' first c1 and c8 steps took 1.1 s against a
# median of 0.08 s).
WARM_DECODE_STEPS = 1
_FILL_CHUNK_ELEMS = 1 << 27  # random fill in slices of at most 128M elements (0.5 GB of fp32 temporaries)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- model -----------------------------------------------------------------------------------------------


def bench_config(
    preset: str = "flash-next", layers: int | None = None, ngram_vocab_base: int | None = None
) -> tuple[ModelConfig, dict[str, Any]]:
    """The preset's text config (with make-model's --layers / --ngram-vocab-base) as a ModelConfig and as
    the raw dict transformers' Qwen4ExpTextConfig takes."""
    text = text_config(preset, preset_overrides(preset, layers, ngram_vocab_base))
    raw = {"model_type": "qwen4_exp_text", "eos_token_id": BENCH_EOS} | text
    return ModelConfig.from_dict(raw), raw


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def random_flash_next(
    cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> FlashNext:
    """A whole FlashNext with random weights drawn directly on `device` in `dtype`: no checkpoint.

    Every parameter is one of `expected_shapes(cfg)` (the loader's runtime names and shapes) and gets the
    distribution make-model gives the tensor of that name (`make_model._init`: 1/sqrt(fan_in) projections,
    unit embeddings, non-zero norm weights), drawn from a generator on the device seeded by (seed, name).
    The values therefore differ from a make-model checkpoint of the same seed; the distributions do not.
    The parameters are allocated in `dtype` from the start (no float32 copy of a 45 GB model).
    """
    device = torch.device(device)
    with _default_dtype(dtype), torch.device(device):
        model = FlashNext(cfg)
    shapes = expected_shapes(cfg)
    params = dict(model.named_parameters())
    if set(params) != set(shapes):
        raise RuntimeError(
            f"FlashNext parameters and loader names differ: only in model "
            f"{sorted(set(params) - set(shapes))}, only in loader {sorted(set(shapes) - set(params))}"
        )
    with torch.no_grad():
        for name, shape in shapes.items():
            p = params[name]
            if tuple(p.shape) != shape:
                raise RuntimeError(f"{name}: model shape {tuple(p.shape)}, loader shape {shape}")
            gen = torch.Generator(device=device).manual_seed(_seed_for(seed, name))
            row = max(1, p.numel() // max(1, shape[0]))
            step = max(1, _FILL_CHUNK_ELEMS // row)
            for start in range(0, shape[0], step):
                part = p[start : start + step]
                with torch.device(device):  # _init draws with torch.randn/rand: on the device's generator
                    part.copy_(_init(name, tuple(part.shape), gen))
    return model.eval()


def engine_for_model(model: FlashNext, device: torch.device, dtype: torch.dtype, **engine_flags: Any):
    """A real LLMEngine (scheduler, pool, state slots, runner) around an already-built model; no
    tokenizer, so prompts are token ids. Everything else is the engine as `LLM` runs it."""
    from .engine.engine import LLMEngine

    dtype_name = next(name for name, dt in DTYPES.items() if dt == dtype)
    return LLMEngine(EngineConfig(device=str(device), dtype=dtype_name, **engine_flags), model=model)


# ---- measuring helpers ------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EnergyMeter:
    """NVML's total-energy counter (mJ since driver load) of the benchmark's GPU; None where unavailable."""

    def __init__(self, device: torch.device) -> None:
        self.handle, self.error, self.nvml = None, None, None
        if device.type != "cuda":
            self.error = "not a CUDA device"
            return
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            self.nvml = pynvml
            index = device.index if device.index is not None else torch.cuda.current_device()
            try:
                uuid = str(torch.cuda.get_device_properties(index).uuid)
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(
                    uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
                )
            except Exception:  # noqa: BLE001 - older torch or a MIG uuid: fall back to the index
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except Exception as exc:  # noqa: BLE001
            self.handle, self.error = None, f"{type(exc).__name__}: {exc}"

    def read_mj(self) -> int | None:
        if self.handle is None:
            return None
        try:
            return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except Exception as exc:  # noqa: BLE001
            self.error = f"{type(exc).__name__}: {exc}"
            return None


class Window:
    """Wall time (after a device sync) and energy of one measured region."""

    def __init__(self, device: torch.device, meter: EnergyMeter) -> None:
        self.device, self.meter = device, meter

    def __enter__(self) -> Window:
        _sync(self.device)
        self.e0, self.t0 = self.meter.read_mj(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        _sync(self.device)
        self.seconds = time.perf_counter() - self.t0
        e1 = self.meter.read_mj()
        self.joules = None if self.e0 is None or e1 is None else (e1 - self.e0) / 1000.0

    def energy(self, tokens: int) -> dict[str, float | None]:
        if self.joules is None:
            return {"energy_J": None, "J_per_token": None, "avg_power_W": None}
        return {
            "energy_J": round(self.joules, 3),
            "J_per_token": round(self.joules / tokens, 4) if tokens else None,
            "avg_power_W": round(self.joules / self.seconds, 1) if self.seconds > 0 else None,
        }


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 20) -> dict[str, Any]:
    """Device-to-device copy of `nbytes` (random bf16 data), bytes read + written over the median time."""
    n = nbytes // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    assert torch.equal(dst[:1024], src[:1024])
    med = statistics.median(times)
    moved = 2 * n * 2
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "bytes_copied": n * 2,
        "bytes_moved": moved,
        "median_s": med,
        "GB_per_s": round(moved / med / 1e9, 1),
        "how": f"dst.copy_(src) of {n * 2 / 2**30:.2f} GiB, median of {repeats} after 3 warm-ups",
    }


# ---- the roofline ------------------------------------------------------------------------------------------


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts `tokens` uniformly routed tokens touch (each picks top_k)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def decode_step_bytes(
    cfg: ModelConfig,
    concurrency: int,
    context: int,
    weight_bytes: int = 2,
    kv_bytes: int = 2,
    state_bytes: int = 4,
) -> dict[str, Any]:
    """Bytes one decode step of `concurrency` sequences at `context` tokens each must move in device memory.

    Counted from the config, each byte once (perfect reuse within the step):
    - weights read: every dense tensor of `expected_shapes` in full (HC norms and mixes, GDN / QSA and
      indexer projections, router, shared expert and its gate, PLE projections, final mixer, lm_head);
      one embedding row and one PLE row per n-gram head per sequence; of the routed experts, the expected
      number of distinct experts the step's tokens pick (10 at concurrency 1; uniform routing otherwise);
    - state read and written per sequence: GDN conv window (model dtype) and recurrent state (float32,
      read and written), PLE conv history, the indexer's open-block tail; QSA K/V of the selected tokens
      (min(context, budget + c - 1)), compressed indexer keys of every visible block when they must be
      scored (more visible blocks than block_topk); the new token's K/V and raw indexer key written.
    Activations and logits are not counted (a fused kernel keeps them on chip).
    """
    B, t = concurrency, context
    shapes = expected_shapes(cfg)
    dense = routed = rows = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        if name == "embed_tokens.weight":
            rows += B * shape[1] * weight_bytes
        elif name.endswith("ngram_embedding.weight"):
            rows += B * cfg.ple_num_heads * shape[1] * weight_bytes
        elif name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            per_expert = n // cfg.num_experts
            touched = expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, B)
            routed += touched * per_expert * weight_bytes
        else:
            dense += n * weight_bytes
    nG, nQ, nP = len(cfg.gdn_layers), len(cfg.qsa_layers), len(cfg.ple_layers)
    c = cfg.indexer_compress_ratio
    gdn_conv = (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim * kv_bytes
    gdn_rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * state_bytes
    ple_conv = (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size * cfg.hc_hidden * kv_bytes
    tail = (c - 1) * cfg.indexer_head_dim * kv_bytes
    kv_token = 2 * cfg.num_key_value_heads * cfg.head_dim * kv_bytes
    visible_blocks = (t + 1) // c
    selected = min(t + 1, cfg.indexer_budget + c - 1) if visible_blocks > cfg.block_topk else t + 1
    scored_blocks = visible_blocks if visible_blocks > cfg.block_topk else 0
    state_read = B * (
        nG * (gdn_conv + gdn_rec)
        + nP * ple_conv
        + nQ * (tail + selected * kv_token + scored_blocks * cfg.indexer_head_dim * kv_bytes)
    )
    state_written = B * (
        nG * (gdn_conv + gdn_rec) + nP * ple_conv + nQ * (kv_token + cfg.indexer_head_dim * kv_bytes)
    )
    weights = dense + routed + rows
    return {
        "concurrency": B,
        "context": t,
        "weights_read": int(weights),
        "weights_dense": int(dense),
        "weights_routed_experts": int(routed),
        "weights_embedding_rows": int(rows),
        "expected_distinct_experts_per_layer": round(
            expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, B), 2
        ),
        "state_read": int(state_read),
        "state_written": int(state_written),
        "total": int(weights + state_read + state_written),
    }


def roofline(cfg: ModelConfig, concurrency: int, context: int, bandwidth: float) -> dict[str, Any]:
    step = decode_step_bytes(cfg, concurrency, context)
    seconds = step["total"] / bandwidth
    return {"bytes_per_step": step, "step_s": seconds, "tok_per_s": round(concurrency / seconds, 1)}


# ---- the nextserve workload --------------------------------------------------------------------------------


def _prompt(rng: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(FIRST_PROMPT_ID, vocab, (n,), generator=rng).tolist()


def ns_prefill(engine, prompt: list[int], meter: EnergyMeter) -> dict[str, Any]:
    """One request of max_tokens 1: its chunked prefill and first token (TTFT = prefill time)."""
    from .engine.sampling import SamplingParams

    device = engine.device
    _reset_peak(device)
    token = None
    with Window(device, meter) as w:
        rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        steps = 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid and out.token_ids:
                    token = out.token_ids[0]
            steps += 1
    return {
        "prompt_len": len(prompt),
        "engine_steps": steps,
        "first_token": token,
        "ttft_s": round(w.seconds, 4),
        "prefill_tok_per_s": round(len(prompt) / w.seconds, 1),
        **w.energy(len(prompt)),
        "peak_memory_bytes": _peak(device),
    }


def decode_max_tokens(concurrency: int, prompt_len: int, prefill_chunk: int, steps: int) -> int:
    """max_tokens for a decode run: no request may finish before the last one has its first token (the
    scheduler runs one prefill chunk per step, so the first request decodes while the others prefill)."""
    return concurrency * -(-prompt_len // prefill_chunk) + WARM_DECODE_STEPS + steps + 2


def ns_decode(engine, prompts: list[list[int]], steps: int, meter: EnergyMeter) -> dict[str, Any]:
    """`len(prompts)` concurrent requests: prefill them all (the scheduler's own mix of prefill chunks and
    decodes), then time `steps` engine steps in which every request decodes one token; then abort them."""
    from .engine.sampling import SamplingParams

    device = engine.device
    B = len(prompts)
    max_tokens = decode_max_tokens(B, len(prompts[0]), engine.config.prefill_chunk, steps)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    _reset_peak(device)
    _sync(device)
    t_add = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    seqs = [engine.sequences[i] for i in ids]
    first: dict[str, float] = {}
    while len(first) < B:
        engine.step()
        now = time.perf_counter()
        for s in seqs:
            if s.output_ids and s.request_id not in first:
                first[s.request_id] = now - t_add
    for _ in range(WARM_DECODE_STEPS):
        engine.step()
    before = [len(s.output_ids) for s in seqs]
    step_s = []
    with Window(device, meter) as w:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            _sync(device)
            step_s.append(time.perf_counter() - t0)
    made = [len(s.output_ids) - b for s, b in zip(seqs, before, strict=True)]
    # Context of each request at the middle of the window (early ones decoded while others prefilled).
    mean_context = statistics.mean(
        len(s.prompt_ids) + b + steps / 2 for s, b in zip(seqs, before, strict=True)
    )
    if made != [steps] * B or any(s.finished for s in seqs):
        raise RuntimeError(f"decode steps did not advance every request once per step: {made}")
    for rid in ids:
        engine.abort(rid)
    engine.step()  # forgets the aborted requests
    stats = engine.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"], stats
    ttfts = sorted(first.values())
    tokens = B * steps
    return {
        "concurrency": B,
        "prompt_len": len(prompts[0]),
        "decode_steps": steps,
        "mean_context": round(mean_context, 1),
        "decode_tok_per_s": round(tokens / w.seconds, 2),
        "decode_tok_per_s_median_step": round(B / statistics.median(step_s), 2),
        "step_s_median": round(statistics.median(step_s), 5),
        "step_s_min": round(min(step_s), 5),
        "step_s_max": round(max(step_s), 5),
        "ttft_s_first": round(ttfts[0], 4),
        "ttft_s_last": round(ttfts[-1], 4),
        **w.energy(tokens),
        "peak_memory_bytes": _peak(device),
    }


def _module_kind(module: torch.nn.Module) -> str | None:
    from .model.gated_deltanet import GatedDeltaNet
    from .model.hyper import GatedResidual
    from .model.moe import SharedExpert, SparseMoe
    from .model.ple import PLE
    from .model.qsa import Indexer, QSAttention

    kinds = {
        GatedDeltaNet: "gdn",
        QSAttention: "qsa_attention",
        Indexer: "qsa_indexer",
        SparseMoe: "moe_routed_and_router",
        SharedExpert: "moe_shared_expert",
        PLE: "ple",
        GatedResidual: "hyper_connection",
    }
    return kinds.get(type(module))


def profile_decode_step(engine, prompt: list[int], meter: EnergyMeter, top: int = 12) -> dict[str, Any]:
    """Where one decode step at concurrency 1 spends its time.

    (1) Self wall time per module kind (device synced at every module boundary, so each module's time
    includes its kernels): HC, GDN, QSA attention and indexer, MoE (router + routed experts) and shared
    expert, PLE; the rest of the step (embedding, logits, sampling, scheduling) is `outside_modules`.
    (2) torch.profiler over one more step: device activity count, summed kernel time and the top ops."""
    from .engine.sampling import SamplingParams

    device = engine.device
    rid = engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    seq = engine.sequences[rid]
    while not seq.output_ids:
        engine.step()
    engine.step()  # one plain decode step first

    totals: dict[str, float] = {}
    stack: list[list[float]] = []  # [start, child time]

    def pre(module, _args):
        _sync(device)
        stack.append([time.perf_counter(), 0.0])

    def post(module, _args, _out):
        _sync(device)
        start, child = stack.pop()
        took = time.perf_counter() - start
        kind = _module_kind(module)
        totals[kind] = totals.get(kind, 0.0) + took - child
        if stack:
            stack[-1][1] += took

    handles = []
    for m in engine.model.modules():
        if _module_kind(m) is not None:
            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        with Window(device, meter) as w:
            engine.step()
    finally:
        for h in handles:
            h.remove()
    in_modules = sum(totals.values())
    per_kind = {k: round(v * 1000, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    per_kind["outside_modules"] = round((w.seconds - in_modules) * 1000, 3)

    result: dict[str, Any] = {
        "what": "one engine.step() at concurrency 1 (one decode token), after a warm-up decode step",
        "step_ms_with_module_syncs": round(w.seconds * 1000, 3),
        "self_ms_per_module_kind": per_kind,
    }
    try:
        result |= _torch_profile(engine, top)
    except Exception as exc:  # noqa: BLE001 - the profile is a help, not a result
        result["profiler_error"] = f"{type(exc).__name__}: {exc}"
    while engine.has_unfinished():
        engine.step()
    return result


def _torch_profile(engine, top: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile, schedule

    device = engine.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # One warm-up cycle first: the profiler's own start (4.5 s on the H200 run of 2026-11-30) stays out.
    got: dict[str, Any] = {}

    def ready(prof) -> None:  # the cycle's events, before the profiler clears them
        got["events"], got["averages"] = list(prof.events()), list(prof.key_averages())

    cycle = schedule(wait=0, warmup=1, active=1)
    with (
        warnings.catch_warnings(),  # "clears events at the end of each cycle": `ready` has them
        profile(activities=activities, schedule=cycle, on_trace_ready=ready) as prof,
    ):
        warnings.filterwarnings("ignore", message=".*clears events at the end of each cycle.*")
        engine.step()
        prof.step()
        _sync(device)
        t0 = time.perf_counter()
        engine.step()
        _sync(device)
        wall = time.perf_counter() - t0
        prof.step()

    def dev_time(e) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) or 0.0)

    events = got["events"]
    on_device = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in on_device)
    ops = sorted(
        (e for e in got["averages"] if not e.key.startswith("ProfilerStep")),
        key=lambda e: -e.self_cpu_time_total,
    )[:top]
    return {
        "profiled_step_ms": round(wall * 1000, 3),
        "device_activities": len(on_device),
        "device_busy_ms": round(busy_us / 1000, 3),
        "host_events": len(events) - len(on_device),
        "top_ops_by_self_cpu": [
            {
                "op": e.key,
                "count": e.count,
                "self_cpu_ms": round(e.self_cpu_time_total / 1000, 3),
                "self_device_ms": round(dev_time(e) / 1000, 3),
            }
            for e in ops
        ],
    }


# ---- the transformers workload -----------------------------------------------------------------------------


def transformers_model(
    raw_config: dict[str, Any], ns_model: FlashNext, device: torch.device, dtype: torch.dtype
):
    """transformers' Qwen4ExpForCausalLM on `device` in `dtype` holding ns_model's weights."""
    import transformers
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    fields = {k: v for k, v in raw_config.items() if k != "model_type"}
    config = Qwen4ExpTextConfig(**fields)
    with _default_dtype(dtype), torch.device(device):
        hf = Qwen4ExpForCausalLM(config)
    state = {(k if k.startswith("lm_head.") else f"model.{k}"): v for k, v in ns_model.state_dict().items()}
    result = hf.load_state_dict(state, strict=False)
    buffers = {n for n, _ in hf.named_buffers()}
    missing = [k for k in result.missing_keys if k not in buffers]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"weights do not map: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    hf.eval()
    info = {
        "version": transformers.__version__,
        "module": transformers.__file__,
        "attn_implementation": getattr(hf.config, "_attn_implementation", None),
        "experts_implementation": getattr(hf.config, "_experts_implementation", None),
    }
    try:
        import fla  # noqa: F401

        info["flash_linear_attention"] = True
    except ImportError:
        info["flash_linear_attention"] = False
    return hf, info


@torch.inference_mode()
def hf_run(
    hf, prompts: list[list[int]], new_tokens: int, device: torch.device, meter: EnergyMeter, warm: int = 0
) -> dict:
    """Greedy decode with a DynamicCache, as `generate` runs it: one forward over the whole batch of prompts
    (equal lengths, no padding), then one forward per token (`warm` untimed, then `new_tokens` timed).
    Returns timings and the tokens."""
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    B = ids.shape[0]
    _reset_peak(device)
    with Window(device, meter) as wp:
        out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1)
        tokens = [tok.tolist()]
    cache = out.past_key_values
    for _ in range(warm):
        out = hf(input_ids=tok[:, None], past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1)
        tokens.append(tok.tolist())
    step_s = []
    with Window(device, meter) as wd:
        for _ in range(new_tokens):
            t0 = time.perf_counter()
            out = hf(input_ids=tok[:, None], past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1)
            tokens.append(tok.tolist())
            step_s.append(time.perf_counter() - t0)
    del cache, out
    return {"prefill": wp, "decode": wd, "step_s": step_s, "tokens": tokens, "B": B}


def hf_prefill(hf, prompt: list[int], device: torch.device, meter: EnergyMeter) -> dict[str, Any]:
    r = hf_run(hf, [prompt], 0, device, meter)
    w = r["prefill"]
    return {
        "prompt_len": len(prompt),
        "first_token": r["tokens"][0][0],
        "ttft_s": round(w.seconds, 4),
        "prefill_tok_per_s": round(len(prompt) / w.seconds, 1),
        **w.energy(len(prompt)),
        "peak_memory_bytes": _peak(device),
    }


def hf_decode(hf, prompts: list[list[int]], steps: int, device: torch.device, meter: EnergyMeter) -> dict:
    r = hf_run(hf, prompts, steps, device, meter, warm=WARM_DECODE_STEPS)
    w, tokens = r["decode"], len(prompts) * steps
    return {
        "concurrency": len(prompts),
        "prompt_len": len(prompts[0]),
        "decode_steps": steps,
        "decode_tok_per_s": round(tokens / w.seconds, 2),
        "decode_tok_per_s_median_step": round(len(prompts) / statistics.median(r["step_s"]), 2),
        "step_s_median": round(statistics.median(r["step_s"]), 5),
        "step_s_min": round(min(r["step_s"]), 5),
        "step_s_max": round(max(r["step_s"]), 5),
        "ttft_s_first": round(r["prefill"].seconds, 4),
        "ttft_s_last": round(r["prefill"].seconds, 4),
        **w.energy(tokens),
        "peak_memory_bytes": _peak(device),
    }


# ---- the run -----------------------------------------------------------------------------------------------


def git_info(override: str | None) -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=30
        ).stdout.strip()

    info: dict[str, Any] = {"revision": None, "dirty": None}
    try:
        rev = git("rev-parse", "HEAD")
        if rev:
            info = {"revision": rev, "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        pass
    if override:
        info["given"] = override  # the tree was copied without .git (the GPU machine): the caller says
    return info


def hardware(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": props.name,
            "gpu_memory_bytes": props.total_memory,
            "multiprocessors": props.multi_processor_count,
            "cuda": torch.version.cuda,
        }
        with contextlib.suppress(Exception):
            smi = subprocess.run(
                ["nvidia-smi", "--format=csv,noheader",
                 "--query-gpu=driver_version,clocks.sm,clocks.mem,power.limit"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            info["nvidia_smi"] = smi.stdout.strip()
    return info


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="flash-next", help="make-model preset (default: flash-next)")
    p.add_argument(
        "--layers", type=int, default=None, metavar="N", help="decoder layers (default: the preset's)"
    )
    p.add_argument(
        "--ngram-vocab-base", type=int, default=None, metavar="B", help="PLE ngram_vocab_size_base"
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on cuda, float32 on cpu) or a dtype name")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument(
        "--prompt-lens", type=int, nargs="+", default=[1024], metavar="L",
        help="prefill prompt lengths (default: 1024; issue 6 also asks 8192 32768)",
    )  # fmt: skip
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], metavar="B")
    p.add_argument("--decode-steps", type=int, default=6, help="timed decode steps per concurrency")
    p.add_argument(
        "--decode-prompt-len", type=int, default=256, help="prompt tokens of each decoding request"
    )
    p.add_argument("--prefill-chunk", type=int, default=1024, help="engine prefill chunk")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument(
        "--transformers", action=argparse.BooleanOptionalAction, default=True,
        help="also run the workload through transformers' Qwen4ExpForCausalLM",
    )  # fmt: skip
    p.add_argument(
        "--profile", action=argparse.BooleanOptionalAction, default=True, help="profile one decode step"
    )
    p.add_argument(
        "--copy-mib", type=int, default=None, help="copy-bandwidth buffer (default 4096 on cuda, 64 cpu)"
    )
    p.add_argument(
        "--budget-s", type=float, default=300.0,
        help="prompt lengths beyond the first are skipped once the run would pass this many seconds",
    )  # fmt: skip
    p.add_argument("--revision", default=None, help="git revision to record when the tree has no .git")
    p.add_argument("--out", default=None, help="also write the JSON here (rewritten after every phase)")


class _Run:
    def __init__(self, args: argparse.Namespace, command: str) -> None:
        self.args, self.t0 = args, time.perf_counter()
        self.result: dict[str, Any] = {
            "benchmark": "gpu_baseline",
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


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


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
    # Admission reserves prompt + max_tokens for every request (C2): room for all of them at once.
    per_request = dplen + decode_max_tokens(max_conc, dplen, args.prefill_chunk, steps) + args.page_size
    capacity = max(max(args.prompt_lens) + 8, max_conc * per_request, 256)
    capacity = -(-capacity // args.page_size) * args.page_size
    engine_flags = dict(
        prefill_chunk=args.prefill_chunk, max_concurrency=max_conc, kv_capacity=capacity,
        max_context=capacity, page_size=args.page_size, max_pending=max(256, max_conc),
    )  # fmt: skip

    def nextserve_engine():
        t = time.perf_counter()
        model = random_flash_next(cfg, device, dtype, args.seed)
        _sync(device)
        built = time.perf_counter() - t
        engine = engine_for_model(model, device, dtype, **engine_flags)
        log(f"nextserve model built in {built:.1f} s; warm-up")
        ns_decode(engine, [_prompt(rng, V, warm_len) for _ in range(2)], 2, meter)
        return model, engine, built

    rng = torch.Generator().manual_seed(args.seed + 1)
    V = cfg.vocab_size
    lengths = list(dict.fromkeys(args.prompt_lens))
    prefill_prompts = {L: _prompt(rng, V, L) for L in lengths}
    decode_prompts = {B: [_prompt(rng, V, dplen) for _ in range(B)] for B in args.concurrency}

    model, engine, built = nextserve_engine()
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
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "build_s": round(built, 2),
        "weights": "random, drawn on the device by nextserve.bench.random_flash_next (no checkpoint)",
    }
    res["engine"] = {
        **engine_flags,
        "path": "LLMEngine.step(): Scheduler.schedule -> ModelRunner.execute -> update (what LLM.generate "
        "runs); reference ops (nextserve/ops), row-invariant decode, no kernels, no CUDA graphs",
    }
    ns: dict[str, Any] = {"prefill": [], "decode": []}
    res["nextserve"] = ns
    log(f"nextserve prefill {lengths[0]}")
    ns["prefill"].append(ns_prefill(engine, prefill_prompts[lengths[0]], meter))
    run.save()
    for B in args.concurrency:
        log(f"nextserve decode concurrency {B}")
        r = ns_decode(engine, decode_prompts[B], steps, meter)
        r["roofline"] = roofline(cfg, B, round(r["mean_context"]), bandwidth)
        r["roofline_fraction"] = round(r["decode_tok_per_s"] / r["roofline"]["tok_per_s"], 5)
        ns["decode"].append(r)
        run.save()
    if args.profile:
        log("nextserve profile of one decode step")
        ns["profile_decode_c1"] = profile_decode_step(engine, _prompt(rng, V, dplen), meter)
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
            hf_run(hf, [_prompt(rng, V, warm_len) for _ in range(2)], 2, device, meter)
            log(f"transformers prefill {lengths[0]}")
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
    # nextserve's per-row reference ops, with margin for transformers' quadratic attention masks).
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
    todo = [L for L in lengths[1:] if run.fits(f"nextserve prefill {L}", ns_per_token * L * 1.5 + 2 * built)]
    if todo:
        model, engine, _ = nextserve_engine()
        for L in todo:
            if L != todo[0] and not run.fits(f"nextserve prefill {L}", ns_per_token * L * 1.5):
                continue
            log(f"nextserve prefill {L}")
            r = ns_prefill(engine, prefill_prompts[L], meter)
            ns_per_token = max(ns_per_token, r["ttft_s"] / L)
            ns["prefill"].append(r)
            run.save()
        del engine, model
        _free(device)

    res["ratios_nextserve_over_transformers"] = _ratios(ns, hf_res)
    res["notes"] = [
        "nextserve runs its plain-PyTorch reference ops (no kernels, no CUDA graphs); decode is "
        "row-invariant.",
        "prefill: one request, max_tokens 1; TTFT = add_request to first token; nextserve prefills in chunks "
        "of prefill_chunk, transformers in one forward over the whole prompt.",
        "decode: all requests prefilled first (the scheduler's own mix), then decode_steps timed steps in "
        "which every request decodes one token; greedy, ignore_eos; random-token prompts.",
        "transformers: the same weights and prompts; greedy with its DynamicCache, one forward per token "
        "for the whole batch (generate's loop without its bookkeeping).",
        "roofline: bytes_per_step / copy bandwidth; decode_step_bytes in nextserve/bench.py says what is "
        "counted.",
    ]
    run.save()
    return res


def _ratios(ns: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    if not hf.get("ran"):
        return {}
    out: dict[str, Any] = {}
    hf_pre = {r["prompt_len"]: r for r in hf.get("prefill", []) if "error" not in r}
    for r in ns["prefill"]:
        h = hf_pre.get(r["prompt_len"])
        if h:
            out[f"prefill_tok_per_s@{r['prompt_len']}"] = _ratio(
                r["prefill_tok_per_s"], h["prefill_tok_per_s"]
            )
            # Same weights and prompt: the greedy first tokens should agree (bf16 near-ties aside).
            out[f"same_first_token@{r['prompt_len']}"] = r["first_token"] == h["first_token"]
    hf_dec = {r["concurrency"]: r for r in hf.get("decode", [])}
    for r in ns["decode"]:
        h = hf_dec.get(r["concurrency"])
        if h:
            out[f"decode_tok_per_s@c{r['concurrency']}"] = _ratio(
                r["decode_tok_per_s"], h["decode_tok_per_s"]
            )
            out[f"J_per_token@c{r['concurrency']}"] = _ratio(r["J_per_token"], h["J_per_token"])
    return out


def summary(res: dict[str, Any]) -> str:
    """A few lines for a terminal: what the JSON says, side by side."""
    hf = res.get("transformers", {})
    lines = [
        f"copy bandwidth {res['copy_bandwidth']['GB_per_s']} GB/s; transformers ran: {hf.get('ran')} "
        f"{hf.get('reason', '') or hf.get('error', '')}"
    ]
    hf_pre = {r["prompt_len"]: r for r in hf.get("prefill", []) if "error" not in r}
    for r in res["nextserve"]["prefill"]:
        h = hf_pre.get(r["prompt_len"], {})
        lines.append(
            f"prefill {r['prompt_len']:>6}: nextserve {r['prefill_tok_per_s']:>9} tok/s "
            f"ttft {r['ttft_s']:.3f} s J/tok {r['J_per_token']} | "
            f"transformers {h.get('prefill_tok_per_s')} tok/s ttft {h.get('ttft_s')}"
        )
    hf_dec = {r["concurrency"]: r for r in hf.get("decode", [])}
    for r in res["nextserve"]["decode"]:
        h = hf_dec.get(r["concurrency"], {})
        lines.append(
            f"decode c{r['concurrency']:<3}: nextserve {r['decode_tok_per_s']:>8} tok/s "
            f"({100 * r['roofline_fraction']:.2f}% of {r['roofline']['tok_per_s']}) "
            f"J/tok {r['J_per_token']} | "
            f"transformers {h.get('decode_tok_per_s')} tok/s J/tok {h.get('J_per_token')}"
        )
    prof = res["nextserve"].get("profile_decode_c1")
    if prof:
        lines.append(f"decode step c1 self ms by module: {prof['self_ms_per_module_kind']}")
        lines.append(
            f"profiled step {prof.get('profiled_step_ms')} ms, device busy {prof.get('device_busy_ms')} ms, "
            f"{prof.get('device_activities')} device activities"
        )
    lines += [f"skipped: {s}" for s in res["skipped"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "nextserve bench") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_from_args(args, shlex.join([prog, *(sys.argv[1:] if argv is None else argv)]))


def run_from_args(args: argparse.Namespace, command: str | None = None) -> int:
    """Runs the benchmark and prints its JSON on stdout (progress goes to stderr)."""
    res = run(args, command or shlex.join(sys.argv))
    print(json.dumps(res, indent=2))
    print(summary(res), file=sys.stderr)
    return 0
