"""Prometheus metrics of the server, in a registry of its own (one per app)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..bench.meters import EnergyMeter

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0)


class _EngineCollector(Collector):
    """Gauges read from the engine at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, int]], device: torch.device | None = None) -> None:
        self.stats = stats
        # NOTE: NVML's counter of the engine's GPU (nvidia-ml-py), read at each scrape; none on the CPU
        meter = EnergyMeter(device) if device is not None and device.type == "cuda" else None
        self.energy = meter if meter is not None and meter.handle is not None else None
        self.mj0 = (self.energy.read_mj() or 0) if self.energy is not None else 0

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            s = self.stats()
        except Exception:  # noqa: BLE001 - a scrape never fails the server
            return
        gauges = {
            "nextserve_queue_depth": ("Requests waiting for admission", s.get("waiting", 0)),
            "nextserve_running_sequences": ("Sequences admitted and running", s.get("running", 0)),
            "nextserve_kv_pages_in_use": (
                "KV pages taken",
                s.get("kv_pages_total", 0) - s.get("kv_pages_free", 0),
            ),
            "nextserve_kv_pages_total": ("KV pages in the pool", s.get("kv_pages_total", 0)),
            "nextserve_state_slots_in_use": (
                "Recurrent-state slots taken",
                s.get("state_slots_total", 0) - s.get("state_slots_free", 0),
            ),
            "nextserve_state_slots_total": ("Recurrent-state slots", s.get("state_slots_total", 0)),
            "nextserve_preempted_sequences": (
                "Preempted sequences waiting in host memory to resume",
                s.get("preempted_waiting", 0),
            ),
            "nextserve_prefix_images": ("Prefix images kept on the device", s.get("prefix_images", 0)),
            "nextserve_host_prefix_images": ("Prefix images kept in host memory", s.get("host_images", 0)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {  # speculative decoding (vLLM's spec_decode_num_draft/accepted_tokens)
            "nextserve_spec_draft_tokens": ("Draft tokens checked by verify windows", "spec_draft_tokens"),
            "nextserve_spec_accepted_tokens": ("Draft tokens accepted", "spec_accepted_tokens"),
            "nextserve_pipeline_windows_held": (
                "Guessed windows the front pipeline stages ran ahead, committed (--pipeline-windows)",
                "pipeline_windows_held",
            ),
            "nextserve_pipeline_windows_dropped": (
                "Guessed windows the front pipeline stages ran ahead, dropped (--pipeline-windows)",
                "pipeline_windows_dropped",
            ),
            "nextserve_preemptions": ("Running sequences moved to host memory for pages", "preemptions"),
            "nextserve_preempted_resumes": (
                "Preempted sequences resumed from host memory",
                "preempted_resumes",
            ),
            "nextserve_prefix_cache_hits": ("Prompts that resumed from a prefix image", "prefix_hits"),
            "nextserve_prefix_cache_misses": ("Prompts that found no prefix image", "prefix_misses"),
            "nextserve_expert_cache_hits": (
                "Routed (token, expert) pairs whose expert was in the device expert cache",
                "expert_cache_hits",
            ),
            "nextserve_expert_cache_misses": (
                "Routed (token, expert) pairs whose expert was read from host memory",
                "expert_cache_misses",
            ),
            "nextserve_expert_cache_fills": (
                "Experts copied into the device expert cache",
                "expert_cache_fills",
            ),
            "nextserve_expert_cache_link_bytes": (
                "Bytes of routed experts read or copied over the host link (an estimate: a read per call)",
                "expert_cache_link_bytes",
            ),
        }
        for name, (doc, key) in counters.items():
            yield CounterMetricFamily(name, doc, value=s.get(key, 0))
        if self.energy is not None and (mj := self.energy.read_mj()) is not None:
            doc = "GPU energy since the server started (NVML)"
            yield CounterMetricFamily("nextserve_gpu_energy_joules", doc, value=(mj - self.mj0) / 1e3)


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, int]], device: torch.device | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "nextserve_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "nextserve_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter("nextserve_generation_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter(
            "nextserve_cached_prompt_tokens", "Prompt tokens resumed from the prefix cache", registry=r
        )
        self.finished = Counter(
            "nextserve_requests_finished",
            "Generation requests by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "nextserve_time_to_first_token_seconds", "Time to first token", buckets=_TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "nextserve_inter_token_latency_seconds",
            "Time between generated tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "nextserve_e2e_request_latency_seconds", "Request latency", buckets=_E2E_BUCKETS, registry=r
        )
        r.register(_EngineCollector(stats, device))

    def render(self) -> bytes:
        return generate_latest(self.registry)
