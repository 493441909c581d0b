"""The device memory an engine process may use: what its GPU has free, or with `--gpu-memory-gib N` what a
card of N GiB would have free, so a smaller card's run (a 24 GB one, a shared GPU) is reproduced on a bigger
one: the memory plan and the KV sizing read `free_bytes`, and torch's caching allocator is capped at N GiB
(`cap_device_memory`: torch.cuda.set_per_process_memory_fraction), so an allocation past it fails as it
would on that card."""

from __future__ import annotations

import torch

from ..config import ConfigError

GiB = 2**30


def cap_device_memory(device: torch.device, gib: float | None) -> None:
    """Cap this process's allocations on `device` at `gib` GiB (None: no cap; CPU devices: nothing)."""
    if gib is None or device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    if gib * GiB > total:
        raise ConfigError(f"gpu_memory_gib {gib} is more than {device} has ({total / GiB:.1f} GiB)")
    torch.cuda.set_per_process_memory_fraction(gib * GiB / total, device)


def free_bytes(device: torch.device, gib: float | None = None) -> int:
    """Bytes this process may still allocate on a CUDA `device`: the device's free memory, or with a cap
    the cap less what this process's allocator holds already (and never more than the device has free)."""
    free, _ = torch.cuda.mem_get_info(device)
    if gib is None:
        return free
    return max(0, min(free, int(gib * GiB) - torch.cuda.memory_reserved(device)))
