"""Control traffic between pipeline stages: a standalone Gloo group per stage (no global process group,
so several engines can live in one process), step messages sent from stage 0 (JSON: stage_codec.py, so
nothing that arrives can run code), host tensors (item statuses; activations on the CPU and with
--stage-transport host) sent as raw bytes (bit for bit). Activations between GPUs go by
stage_transport.py."""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from . import stage_codec

TIMEOUT = datetime.timedelta(seconds=600)  # a stage that stops answering fails the step, not forever
STEP_TAG = 1  # step messages; tensors go on tag 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reads_from(data: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether a send of `data` (a byte view the channel keeps) reads t's memory."""
    lo = t.data_ptr()
    return lo <= data.data_ptr() < lo + t.numel() * t.element_size()


class StageChannel:
    """Point-to-point and broadcast traffic of one stage over its own Gloo group (no global state)."""

    def __init__(self, rank: int, world: int, port: int = 0, store: dist.Store | None = None) -> None:
        """Over a store of stage 0's on the local `port`, or over `store` (torchrun's: stage_launch.py)."""
        self.rank, self.world = rank, world
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=TIMEOUT)
        self.store = store
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("gloo", self.store), rank, world, TIMEOUT)
        self._from_stage0 = dist.BroadcastOptions()
        self._from_stage0.rootRank = 0
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Starts sending t; `flush` waits for every send started.

        # NOTE: not waited for here: stage 0 sends a decode batch to stage 1 while the last stage sends
        # it the logits of the step's prefill chunk, and two blocking sends would wait on each other."""
        data = t.contiguous().view(torch.uint8).flatten()
        self.pending.append((self.group.send([data], dst, 0), data))

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []

    def reap(self) -> None:
        """Forget the sends that completed (their buffers), waiting for none."""
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    # NOTE: step messages are point to point (tag STEP_TAG), not a broadcast: a collective would hold
    # stage 0 until every stage reached it, i.e. until the last stage finished its earlier items, and
    # decode groups (one group's next round sent while the others are still in later stages) would run
    # one stage at a time. Each stage takes its messages in the order stage 0 sent them.
    def send_step(self, obj: object) -> None:
        """obj (a StageStep, or None to stop) to every other stage; not waited for (`flush`)."""
        data = torch.frombuffer(bytearray(stage_codec.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
        for dst in range(1, self.world):
            self.pending.append((self.group.send([size], dst, STEP_TAG), size))
            self.pending.append((self.group.send([data], dst, STEP_TAG), data))

    def recv_step(self) -> object:
        size = torch.zeros(1, dtype=torch.long)
        self.group.recv([size], 0, STEP_TAG).wait()
        buf = torch.empty(int(size[0]), dtype=torch.uint8)
        self.group.recv([buf], 0, STEP_TAG).wait()
        return stage_codec.loads(buf.numpy().tobytes())

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        """A host tensor from stage src."""
        buf = torch.empty(shape, dtype=dtype)
        self.recv_into(buf, src)
        return buf

    def recv_into(self, t: torch.Tensor, src: int) -> None:
        """The next tensor from stage src into t (contiguous, on the host, its shape and dtype)."""
        self.group.recv([t.view(torch.uint8).flatten()], src, 0).wait()

    def holds(self, t: torch.Tensor) -> bool:
        """Whether a send not yet done still reads t's memory (so it may not be written yet)."""
        return any(reads_from(data, t) and not work.is_completed() for work, data in self.pending)

    def broadcast(self, obj: object) -> object:
        """obj from stage 0 to every stage (the others pass None)."""
        size = torch.zeros(1, dtype=torch.long)
        data = stage_codec.dumps(obj) if self.rank == 0 else b""
        size[0] = len(data)
        self.group.broadcast([size], self._from_stage0).wait()
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else None
        if buf is None:
            buf = torch.empty(int(size[0]), dtype=torch.uint8)
        self.group.broadcast([buf], self._from_stage0).wait()
        return obj if self.rank == 0 else stage_codec.loads(buf.numpy().tobytes())
