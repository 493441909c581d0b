"""Measuring helpers: device sync, NVML energy, timed windows, peak memory and the copy bandwidth."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


def sync(device: torch.device) -> None:
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
        sync(self.device)
        self.e0, self.t0 = self.meter.read_mj(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        sync(self.device)
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


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
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


def host_link_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> dict[str, Any]:
    """Pinned host memory to the device: `nbytes` copied, over the median time (the link host-held experts
    cross); None off CUDA."""
    if device.type != "cuda":
        return {"GB_per_s": None, "how": "not measured: no GPU"}
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for i in range(3 + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1000.0)
    med = statistics.median(times)
    del src, dst
    torch.cuda.empty_cache()
    return {
        "bytes": nbytes,
        "median_s": med,
        "GB_per_s": round(nbytes / med / 1e9, 2),
        "how": f"pinned host to device copy_ of {nbytes / 2**30:.2f} GiB, median of {repeats} after 3 "
        "warm-ups",
    }
