"""What one stage hop costs, by channel and message size: two processes pass a tensor back and forth (stage
0 sends, stage 1 sends it back) over the Gloo channel (`--stage-transport host`) and the shared-memory rings
(`shm`), as the pipeline's activations travel; a hop is half a round trip. With --device cuda the tensors
live on the GPU and cross as HostTransport moves them (a pinned copy down, the channel, a copy up), and the
device-to-host copy with its stream sync is timed apart, so the hop splits into its parts. --one-process
runs both stages' ends in one process, one after the other (the same channel, copies and syncs): against
two processes it shows what two processes sharing one GPU add (each waits on a device the other drives); it
also times one hop's parts apart (`us_by_part`: the outgoing buffer, copy down and sync, channel send, the
incoming buffer, channel receive and flush, copy up and its sync).

    python benchmarks/bench_stage_hop.py --sizes 20480 163840 1048576 --trips 200
    python benchmarks/bench_stage_hop.py --device cuda [--one-process]

Prints one JSON object (revision, hardware, command, rows: channel, bytes, us a hop, median of trips).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.runtime.shm_channel import ShmChannel  # noqa: E402
from nextserve.runtime.stage_channel import StageChannel, free_port  # noqa: E402
from nextserve.runtime.stage_transport import HostTransport  # noqa: E402

CHANNELS = {"host": StageChannel, "shm": ShmChannel}


def _echo(rank: int, port: int, kind: str, device: str, sizes: list[int], trips: int) -> None:
    """Stage 1: send every tensor straight back."""
    channel = CHANNELS[kind](rank, 2, port)
    transport = HostTransport(channel, torch.device(device))
    channel.broadcast(None)
    for n in sizes:
        for _ in range(trips + 5):
            t = transport.recv((n // 2,), torch.bfloat16, 0)
            transport.send(t, 0)
            channel.flush()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hop_us(trip, t: torch.Tensor, device: torch.device, trips: int) -> float:
    """Median µs of half a round trip (`trip(t)` sends t out and returns it back), warm-up trips left out;
    the tensor must come back bit for bit."""
    times = []
    for i in range(trips + 5):
        _sync(device)
        t0 = time.perf_counter()
        back = trip(t)
        _sync(device)
        if i >= 5:
            times.append(time.perf_counter() - t0)
    assert torch.equal(back, t), "the tensor came back changed"
    return round(statistics.median(times) / 2 * 1e6, 1)


def _run(kind: str, device: torch.device, sizes: list[int], trips: int) -> list[dict]:
    port = free_port()
    argv = [
        sys.executable,
        __file__,
        "--child",
        kind,
        str(port),
        "--device",
        str(device),
        "--trips",
        str(trips),
    ]
    child = subprocess.Popen([*argv, "--sizes", *map(str, sizes)], env=os.environ | {"PYTHONUNBUFFERED": "1"})
    channel = CHANNELS[kind](0, 2, port)
    transport = HostTransport(channel, device)
    channel.broadcast(None)
    rows = []
    for n in sizes:
        t = torch.randn(n // 2, device=device).to(torch.bfloat16)

        def trip(t: torch.Tensor = t) -> torch.Tensor:
            transport.send(t, 1)
            channel.flush()
            return transport.recv(t.shape, t.dtype, 1)

        row = {"channel": kind, "device": str(device), "bytes": n, "processes": 2}
        row["us_a_hop"] = _hop_us(trip, t, device, trips)
        if device.type == "cuda":  # the part HostTransport adds before the channel: pinned copy and its sync
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            parts = []
            for _ in range(trips):
                t0 = time.perf_counter()
                host.copy_(t, non_blocking=True)
                torch.cuda.current_stream(device).synchronize()
                parts.append(time.perf_counter() - t0)
            row["us_device_to_host_copy_and_sync"] = round(statistics.median(parts) * 1e6, 1)
        rows.append(row)
        print(f"# {kind} {n} B: {row['us_a_hop']} us a hop", file=sys.stderr)
    child.wait(timeout=60)
    return rows


def _run_one_process(kind: str, device: torch.device, sizes: list[int], trips: int) -> list[dict]:
    """Both ends in this process: stage 0 sends, stage 1 receives and sends back, stage 0 receives, in turn
    on one thread (the channels are made on two, as their start-up meets)."""
    port, channels = free_port(), [None, None]

    def make(rank: int) -> None:
        channels[rank] = CHANNELS[kind](rank, 2, port)

    makers = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for m in makers:
        m.start()
    for m in makers:
        m.join()
    ends = [HostTransport(c, device) for c in channels]
    rows = []
    for n in sizes:
        t = torch.randn(n // 2, device=device).to(torch.bfloat16)

        def trip(t: torch.Tensor = t) -> torch.Tensor:
            ends[0].send(t, 1)  # (a Gloo send completes once its receive is posted: flushed after it)
            mid = ends[1].recv(t.shape, t.dtype, 0)
            channels[0].flush()
            ends[1].send(mid, 0)
            back = ends[0].recv(t.shape, t.dtype, 1)
            channels[1].flush()
            return back

        us = _hop_us(trip, t, device, trips)
        row = {"channel": kind, "device": str(device), "bytes": n, "processes": 1, "us_a_hop": us}
        rows.append(row | {"us_by_part": _parts(ends, channels, t, trips)})
        print(f"# {kind} {n} B, one process: {us} us a hop, {rows[-1]['us_by_part']}", file=sys.stderr)
    for c in channels:
        if hasattr(c, "close"):  # (the shm rings unmap; a Gloo group goes with the process)
            c.close()
    return rows


def _parts(ends: list[HostTransport], channels: list, t: torch.Tensor, trips: int) -> dict[str, float]:
    """One hop of HostTransport's path, stage 0 to stage 1, each part timed alone (median µs of trips): the
    outgoing pinned buffer, the copy down with its sync, the channel's send, the incoming buffer, the
    channel's receive into it and flush, the copy up queued and waited for. On the CPU only the channel's
    parts run (HostTransport sends a CPU tensor as it is)."""
    cuda = t.device.type == "cuda"
    stream = torch.cuda.current_stream(t.device) if cuda else None
    times: dict[str, list[float]] = {}
    for i in range(trips + 5):
        marks = [("start", time.perf_counter())]

        def mark(part: str, marks: list = marks) -> None:
            marks.append((part, time.perf_counter()))

        host = t
        if cuda:
            host = ends[0].outgoing_buffer(t)
            mark("outgoing_buffer")
            host.copy_(t, non_blocking=True)
            stream.synchronize()
            mark("copy_down_and_sync")
        channels[0].send(host, 1)
        mark("channel_send")
        if cuda:
            slot, got = ends[1].incoming_buffer(t.shape, t.dtype)
            mark("incoming_buffer")
        else:
            got = torch.empty_like(t)
        channels[1].recv_into(got, 0)
        mark("channel_recv")
        channels[0].flush()
        mark("channel_flush")
        if cuda:
            got = ends[1].copy_up(slot, got)
            mark("copy_up_queued")
            stream.synchronize()
            mark("copy_up_sync")
        assert torch.equal(got, t), "the tensor crossed changed"
        if i >= 5:
            for (_, a), (part, b) in zip(marks, marks[1:], strict=False):
                times.setdefault(part, []).append(b - a)
    return {part: round(statistics.median(v) * 1e6, 1) for part, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[20480, 163840, 1048576, 16777216],
                    help="message bytes (20 KB: one token's activations at the released widths)")  # fmt: skip
    ap.add_argument("--trips", type=int, default=200, help="round trips timed per size")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (tensors on the GPU, HostTransport's path)")
    ap.add_argument("--channels", nargs="+", default=["host", "shm"], choices=sorted(CHANNELS))
    ap.add_argument("--one-process", action="store_true", help="also both ends in one process")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.child:
        _echo(1, int(a.child[1]), a.child[0], a.device, a.sizes, a.trips)
        return
    device = torch.device(a.device)
    rows = [r for kind in a.channels for r in _run(kind, device, a.sizes, a.trips)]
    if a.one_process:
        rows += [r for kind in a.channels for r in _run_one_process(kind, device, a.sizes, a.trips)]
    out = {**git_info(), "hardware": hardware(device), "command": " ".join(sys.argv), "rows": rows}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
