"""A pipeline stage process (rank >= 1): `python -m nextserve.runtime.stage_main`, its StageSetup pickled
on stdin (runtime/stage_launch.py starts it), or a torchrun rank >= 1, its setup sent by rank 0
(`torchrun_stage`). It builds its layers on its device, then runs the steps stage 0 sends until a None
step."""

import os
import pickle
import sys
import threading
import time

import torch

from ..cache.pinned_arena import PinnedArena
from .device_memory import cap_device_memory
from .expert_cache import ExpertCache, slots_for_gib
from .mtp_runner import load_head_embedding, load_mtp
from .pipeline import build_stage
from .stage_channel import StageChannel
from .stage_launch import RankSetup, StageSetup, open_channel, rendezvous_channel, torchrun_rank
from .stage_transport import make_transport
from .stage_worker import StageWorker


def _exit_with_parent() -> None:
    """End this stage when the driver process ends, however it ends (a watcher thread)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="nextserve-stage-watch").start()


def stage_main(setup: StageSetup, channel: StageChannel | None = None) -> None:
    torch.set_num_threads(setup.threads)  # the driver's, so its layers compute as in one process (C1)
    _exit_with_parent()
    device = torch.device(setup.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton launches, current streams and NCCL follow it
        cap_device_memory(device, setup.memory_gib)
    torchrun = channel is not None
    if channel is None:
        channel = open_channel(setup.transport, setup.rank, setup.world, setup.port)
    model, pool, slots = build_stage(
        setup.model_dir, setup.cfg, setup.layers, setup.dtype, setup.num_slots, setup.num_pages,
        setup.page_size, device, setup.max_context, setup.window_steps, setup.quantization,
        setup.experts_host, setup.kv_dtype,
    )  # fmt: skip
    if device.type == "cuda" and setup.host_arena_mib:
        pool.host_arena = PinnedArena(setup.host_arena_mib * 2**20)  # (full: a copy pins its own)
    mtp = embed = None
    if setup.mtp_tokens and setup.layers.stop == setup.cfg.num_hidden_layers:  # the MTP block's stage
        mtp = load_mtp(setup.model_dir, setup.cfg, setup.dtype, device, setup.quantization)
        host = setup.head_embedding == "host"
        embed = load_head_embedding(setup.model_dir, setup.cfg, setup.dtype, device, host)
    cache = None
    if setup.experts_host and (cache_slots := slots_for_gib(model, setup.expert_cache_gib)):
        cache = ExpertCache(model, cache_slots, device)  # (before the graphs capture the experts' operands)
    transport = make_transport(setup.transport, channel, device)
    worker = StageWorker(
        model, pool, slots, channel, transport, device, setup.pdl, mtp, setup.mtp_tokens, embed
    )
    if setup.cuda_graph and device.type == "cuda":
        worker.capture_graphs(pool.pages_for(setup.max_context), setup.num_slots, setup.window_steps)
    channel.broadcast(None)  # ready
    while True:
        try:
            step = channel.recv_step()
        except RuntimeError:  # the driver went without a stop (it died): nothing left to serve
            print(
                f"nextserve stage {setup.rank}: the driver closed the connection, stopping", file=sys.stderr
            )
            os._exit(0)
        if step is None:
            break
        worker.run(step, setup.dtype)
        if cache is not None:
            cache.step()
    if torchrun:  # the driver waits for this before it ends (and with it, maybe, the store)
        channel.send(torch.ones(1, dtype=torch.int8), 0)
        channel.flush()
    transport.close()


def torchrun_stage() -> int:
    """This torchrun rank's stage (rank >= 1): its setup from rank 0, then the steps until the stop."""
    run = torchrun_rank()
    assert run is not None and run[0] > 0, "torchrun_stage runs on torchrun's ranks >= 1"
    rank, world, local_rank = run
    channel = rendezvous_channel(rank, world)
    setups = channel.broadcast(None)
    if not isinstance(setups, list) or len(setups) != world or not isinstance(setups[rank], RankSetup):
        print(f"nextserve stage {rank}: rank 0 sent no stage setup for {world} ranks", file=sys.stderr)
        return 1
    stage_main(setups[rank].stage_setup(rank, world, local_rank), channel)
    return 0


if __name__ == "__main__":
    stage_main(pickle.loads(sys.stdin.buffer.read()))
