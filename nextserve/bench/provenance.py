"""What every benchmark records about where it ran: the git revision and the hardware."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


def git_info(override: str | None = None) -> dict[str, Any]:
    """The checkout's HEAD and whether the tree differs from it (None, None outside a git checkout);
    `override` is recorded as "given" (a tree copied without .git: the caller says which revision)."""
    root = Path(__file__).resolve().parents[2]

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


def hardware(device: torch.device | str) -> dict[str, Any]:
    """The host, torch and, on a CUDA device, the GPU (its name, memory, SMs, CUDA and nvidia-smi's driver,
    clocks and power limit); `device` is recorded as given ("cuda", "cuda:0", "cpu")."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "device": str(device),
    }
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
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
