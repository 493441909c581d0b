"""Where one decode step spends its time: self time per module kind, then a torch.profiler summary."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .meters import EnergyMeter, Window, sync


def _module_kind(module: torch.nn.Module) -> str | None:
    from ..model.gated_deltanet import GatedDeltaNet
    from ..model.hyper import GatedResidual
    from ..model.moe import SharedExpert, SparseMoe
    from ..model.ple import PLE
    from ..model.qsa import Indexer, QSAttention

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


@contextlib.contextmanager
def module_self_times(engine, patch_window: bool = False) -> Iterator[dict[str, float]]:
    """Self wall seconds per module kind (`_module_kind`) of what runs inside, filled in as it runs: the
    device is synced at every module boundary, so each module's time includes its kernels. CUDA graphs
    are off inside (a replay has no module boundaries). patch_window: time the modules' `window`
    methods (decode rows) as their `forward` hooks time prefill."""
    device = engine.device
    totals: dict[str, float] = {}
    stack: list[list[float]] = []  # [start, child time]

    def pre(module, _args):
        sync(device)
        stack.append([time.perf_counter(), 0.0])

    def post(module, _args, _out):
        sync(device)
        start, child = stack.pop()
        took = time.perf_counter() - start
        kind = _module_kind(module)
        totals[kind] = totals.get(kind, 0.0) + took - child
        if stack:
            stack[-1][1] += took

    def timed(module, fn):
        def run(*args, **kwargs):
            pre(module, args)
            out = fn(*args, **kwargs)
            post(module, args, out)
            return out

        return run

    handles, patched, graphs = [], [], engine.runner.graphs
    engine.runner.graphs = None
    for m in engine.model.modules():
        if _module_kind(m) is not None:
            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
            if patch_window and hasattr(m, "window"):
                m.window = timed(m, m.window)
                patched.append(m)
    try:
        yield totals
    finally:
        for h in handles:
            h.remove()
        for m in patched:
            del m.window
        engine.runner.graphs = graphs


def profile_decode_step(engine, prompt: list[int], meter: EnergyMeter, top: int = 12) -> dict[str, Any]:
    """Where one decode step at concurrency 1 spends its time.

    (1) Self wall time per module kind (device synced at every module boundary, so each module's time
    includes its kernels): HC, GDN, QSA attention and indexer, MoE (router + routed experts) and shared
    expert, PLE; the rest of the step (embedding, logits, sampling, scheduling) is `outside_modules`.
    (2) torch.profiler over one more step: device activity count, summed kernel time and the top ops."""
    from ..engine.sampling import SamplingParams

    device = engine.device
    rid = engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    seq = engine.sequences[rid]
    while not seq.output_ids:
        engine.step()
    engine.step()  # one plain decode step first

    with module_self_times(engine, patch_window=True) as totals, Window(device, meter) as w:
        engine.step()
    in_modules = sum(totals.values())
    per_kind = {k: round(v * 1000, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    per_kind["outside_modules"] = round((w.seconds - in_modules) * 1000, 3)

    result: dict[str, Any] = {
        "what": "one eager engine.step() at concurrency 1 (one decode token), after a warm-up decode step",
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
        sync(device)
        t0 = time.perf_counter()
        engine.step()
        sync(device)
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


def kernel_table(prof, top: int) -> dict[str, Any]:
    """A torch.profiler run's device kernels summed by name: count, total and the `top` by time."""
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    rows = sorted(((sum(v), len(v), k) for k, v in by_name.items()), reverse=True)
    return {
        "kernels": sum(r[1] for r in rows),
        "kernel_ms_total": round(sum(r[0] for r in rows) / 1000, 3),
        "top": [{"ms": round(t / 1000, 3), "count": n, "name": k[:120]} for t, n, k in rows[:top]],
    }


def gap_table(prof, top: int, min_us: float = 20.0) -> dict[str, Any]:
    """Where the device sat idle in a torch.profiler run: the gaps of at least `min_us` between one device
    activity's end and the next one's start, summed by the pair of kernel names around them (a gap after a
    kernel that the host had not yet followed up: host-bound stretches, syncs). The profiler's own host
    overhead lengthens them; compare pairs, not totals, with an unprofiled TTFT."""
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    by_pair: dict[tuple[str, str], list[float]] = {}
    end, name = None, None
    for s, e, n in spans:
        if end is not None and s - end >= min_us:
            by_pair.setdefault((name[:60], n[:60]), []).append(s - end)
        if end is None or e > end:
            end, name = e, n
    rows = sorted(((sum(v), len(v), k) for k, v in by_pair.items()), reverse=True)
    return {
        "idle_ms_total": round(sum(r[0] for r in rows) / 1000, 3),
        "gaps": sum(r[1] for r in rows),
        "min_gap_us": min_us,
        "top": [
            {"ms": round(t / 1000, 3), "count": c, "after": a, "before": b} for t, c, (a, b) in rows[:top]
        ],
    }


def op_table(prof, top: int) -> list[dict[str, Any]]:
    """A torch.profiler run's (record_shapes) operators by self device time, grouped by input shapes:
    which call a kernel of `kernel_table` came from (Triton launches show as their kernel's name)."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        t = getattr(e, "self_device_time_total", 0.0)
        if t > 0:
            rows.append((t, e.count, e.key, str(e.input_shapes)[:160]))
    rows.sort(reverse=True)
    return [{"ms": round(t / 1000, 3), "count": n, "op": k[:80], "shapes": sh} for t, n, k, sh in rows[:top]]


def profile_prefill(engine, prompt: list[int], top: int = 30) -> dict[str, Any]:
    """Where a cold prefill of `prompt` spends its time (the engine must not resume it from a prefix
    image: build it with prefix_cache=False). Four prefills of it: a warm-up, a plain timed one (TTFT),
    one with module-kind self times (op families, synced at module boundaries), one under torch.profiler
    (kernels summed by name)."""
    from torch.profiler import ProfilerActivity, profile

    from ..engine.sampling import SamplingParams

    device = engine.device
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prefill() -> float:
        rid = engine.add_request(prompt, params)
        seq = engine.sequences[rid]
        sync(device)
        t0 = time.perf_counter()
        while not seq.output_ids:
            engine.step()
        sync(device)
        took = time.perf_counter() - t0
        while engine.has_unfinished():
            engine.step()
        return took

    out: dict[str, Any] = {"tokens": len(prompt), "warm_up_ttft_s": round(prefill(), 3)}
    out["ttft_s"] = round(prefill(), 3)
    with module_self_times(engine) as totals:
        synced = prefill()
    per_kind = {k: round(v * 1000, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    per_kind["outside_modules"] = round((synced - sum(totals.values())) * 1000, 1)
    out["ttft_s_with_module_syncs"] = round(synced, 3)
    out["self_ms_per_module_kind"] = per_kind
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        out["ttft_s_profiled"] = round(prefill(), 3)
    out |= kernel_table(prof, top)
    out["top_ops"] = op_table(prof, top)
    out["device_gaps"] = gap_table(prof, top)
    return out
