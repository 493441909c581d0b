"""A stage process for tests/runtime/test_shm_channel.py: `python shm_peer.py RANK WORLD PORT MODE`.

MODE relay: take each tensor message from the stage before (described by a step message from stage 0) and
send it on to the next stage (the last stage: back to stage 0), sleeping a little first when slow; stop at a
None step. MODE hold: connect, then wait to be killed."""

import sys
import time

import torch

from nextserve.runtime.shm_channel import ShmChannel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64, "uint8": torch.uint8,
          "float16": torch.float16, "int8": torch.int8, "bool": torch.bool}  # fmt: skip


def main(rank: int, world: int, port: int, mode: str) -> None:
    channel = ShmChannel(rank, world, port)
    channel.broadcast(None)  # connected
    if mode == "hold":
        time.sleep(600)
    nxt = (rank + 1) % world
    while True:
        step = channel.recv_step()
        if step is None:
            break
        shape, dtype, slow = step
        t = channel.recv(tuple(shape), DTYPES[dtype], rank - 1)
        if slow:
            time.sleep(0.01)
        channel.send(t, nxt)
    channel.flush()
    channel.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
