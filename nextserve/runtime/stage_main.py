"""A pipeline stage process (rank >= 1): `python -m nextserve.runtime.stage_main`, its StageSetup pickled
on stdin (runtime/pipeline.py starts it). It builds its layers on its device, then runs the steps stage 0
sends until a None step."""

import os
import pickle
import sys
import threading
import time

import torch

from .pipeline import StageSetup, build_stage
from .stage_channel import StageChannel
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


def stage_main(setup: StageSetup) -> None:
    torch.set_num_threads(setup.threads)  # the driver's, so its layers compute as in one process (C1)
    _exit_with_parent()
    device = torch.device(setup.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton launches, current streams and NCCL follow it
    channel = StageChannel(setup.rank, setup.world, setup.port)
    model, pool, slots = build_stage(
        setup.model_dir, setup.cfg, setup.layers, setup.dtype, setup.num_slots, setup.num_pages,
        setup.page_size, device, setup.max_context, setup.window_steps, setup.quantization,
    )  # fmt: skip
    transport = make_transport(setup.transport, channel, device)
    worker = StageWorker(model, pool, slots, channel, transport, device, setup.pdl)
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
    transport.close()


if __name__ == "__main__":
    stage_main(pickle.loads(sys.stdin.buffer.read()))
