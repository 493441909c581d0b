"""What a spill to the host image store costs the engine's thread: fresh pinned host allocations of an
image's size (as the copy worker of session 15 made them while the store grew), alone and on a second thread
while the main thread launches small kernels (a prefill's pattern), against the main thread alone; a
pageable device-to-host copy of the same size on the second thread; and what the store does now: a region
carved out of the host arena locked at start (cache/pinned_arena.py) and an async copy into it, between the
main thread's launches. Prints JSON; run on a CUDA machine:

    python benchmarks/bench_pinned_alloc.py [--mib 25] [--count 20]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from nextserve.bench import hardware
from nextserve.cache.pinned_arena import PinnedArena


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=25, help="bytes of one image (an 8-layer 512-token image: ~25)")
    p.add_argument("--count", type=int, default=20)
    args = p.parse_args()
    n = args.mib << 20
    dev = torch.device("cuda")
    x = torch.randn(4096, 1024, device=dev)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    keep: list[torch.Tensor] = []
    regs: list[torch.Tensor] = []

    def launches(count: int = 3000) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(count):
            x[:16].mul_(1.0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    def pinned() -> None:
        for _ in range(args.count):
            keep.append(torch.empty(n, dtype=torch.uint8, pin_memory=True))

    def registered() -> None:  # pageable memory page-locked by cudaHostRegister (the binding drops the GIL)
        cudart = torch.cuda.cudart()
        for _ in range(args.count):
            buf = torch.empty(n, dtype=torch.uint8)
            cudart.cudaHostRegister(buf.data_ptr(), n, 0)
            regs.append(buf)

    def pageable_copies() -> None:
        for _ in range(args.count):
            keep.append(src.to("cpu"))

    def on_thread(work) -> tuple[float, float]:
        done: list[float] = []

        def run() -> None:
            t = time.perf_counter()
            work()
            done.append(time.perf_counter() - t)

        th = threading.Thread(target=run)
        th.start()
        main_s = launches()
        th.join()
        return main_s, done[0]

    launches()
    res = {"image_mib": args.mib, "count": args.count, "main_alone_s": launches()}
    t = time.perf_counter()
    pinned()
    res["pinned_alloc_ms_each"] = (time.perf_counter() - t) / args.count * 1e3
    res["main_with_pinned_allocs_s"], s = on_thread(pinned)
    res["pinned_allocs_on_thread_ms_each"] = s / args.count * 1e3
    res["main_with_registrations_s"], s = on_thread(registered)
    res["registration_on_thread_ms_each"] = s / args.count * 1e3
    res["main_with_pageable_copies_s"], s = on_thread(pageable_copies)
    res["pageable_copy_on_thread_ms_each"] = s / args.count * 1e3
    for buf in regs:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    regs.clear()
    keep.clear()
    t = time.perf_counter()
    arena = PinnedArena(n * args.count)
    res["arena_lock_s"] = time.perf_counter() - t
    regions = []

    def launches_with_arena_copies(count: int = 3000) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(count):
            x[:16].mul_(1.0)
            if i % (count // args.count) == 0 and len(regions) < args.count:
                region = arena.alloc(n)
                region.take((n,), torch.uint8).copy_(src, non_blocking=True)
                regions.append(region)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    res["main_with_arena_copies_s"] = launches_with_arena_copies()
    regions.clear()
    res["main_after_s"] = launches()
    print(json.dumps({"hardware": hardware(dev)} | res, indent=1))


if __name__ == "__main__":
    main()
