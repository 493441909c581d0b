"""How activations (and the last stage's logits) cross pipeline stages (--stage-transport):

- `host` and `shm`: through host memory over the stages' channel (Gloo: stage_channel.py; shared-memory rings:
  shm_channel.py). On the CPU the tensors are sent as they are; from a GPU they are copied down into a pinned
  buffer first and up to the next stage's GPU from another after (GPUs without peer access), buffers reused
  from hop to hop (hop_buffers.py).
- `nccl`: GPU to GPU over standalone NCCL groups built from the stages' store (no global process group,
  so several engines can live in one process).

Either way a tensor is sent as its raw bytes, so it arrives bit for bit (C1). Item statuses and step
messages stay on Gloo (StageChannel).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from .hop_buffers import HopBuffers
from .stage_channel import TIMEOUT, StageChannel

log = logging.getLogger("nextserve.pipeline")


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).flatten()


class HostTransport:
    """Activations through host memory over the stages' channel (Gloo, or shared-memory rings)."""

    def __init__(self, channel: StageChannel, device: torch.device) -> None:
        self.channel, self.device = channel, device
        pin = device.type == "cuda"
        self.outgoing, self.incoming = HopBuffers(pin), HopBuffers(pin)
        self.copied_up: dict[int, torch.cuda.Event] = {}  # incoming buffer -> its last copy up

    def outgoing_buffer(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned buffer shaped as t that the channel no longer reads (its last send is done)."""
        bufs = self.outgoing.bufs
        _, raw = self.outgoing.take(t.numel() * t.element_size(), lambda i: self.channel.holds(bufs[i]))
        return raw.view(t.dtype).view(t.shape)

    def incoming_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """(i, a pinned buffer [shape] of dtype whose last copy up has run)."""

        def busy(i: int) -> bool:
            done = self.copied_up.get(i)
            return done is not None and not done.query()

        i, raw = self.incoming.take(math.prod(shape) * dtype.itemsize, busy)
        return i, raw.view(dtype).view(shape)

    def copy_up(self, i: int, host: torch.Tensor) -> torch.Tensor:
        """host (incoming buffer i) on this stage's GPU: queued on the current stream, the buffer free again
        once the copy has run."""
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        out.copy_(host, non_blocking=True)
        if i >= 0:
            # NOTE: on the stream the copy went to (the destination's), whatever device is current
            self.copied_up.setdefault(i, torch.cuda.Event()).record(torch.cuda.current_stream(self.device))
        return out

    def send(self, t: torch.Tensor, dst: int) -> None:
        if t.device.type == "cuda":
            host = self.outgoing_buffer(t)
            host.copy_(t, non_blocking=True)
            # NOTE: the channel reads the host buffer (Gloo on its own thread): the copy must be done first.
            torch.cuda.current_stream(t.device).synchronize()
            t = host
        self.channel.send(t, dst)  # the channel keeps the buffer until its send is done (`holds`)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        if self.device.type != "cuda":
            return self.channel.recv(shape, dtype, src)
        i, host = self.incoming_buffer(shape, dtype)
        self.channel.recv_into(host, src)
        return self.copy_up(i, host)

    def flush(self) -> None:
        """The channel's sends (StageWorker flushes the channel itself)."""

    def close(self) -> None:
        pass


def _nccl_group(store: dist.Store, prefix: str, rank: int, world: int) -> dist.ProcessGroupNCCL:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = TIMEOUT
    return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, world, opts)


class NcclTransport:
    """Activations GPU to GPU over NCCL: stage r sends to r+1 on the `forward` group, the last stage
    sends logits to stage 0 on the `back` group.

    # NOTE: two groups, because NCCL runs a communicator's sends and receives in order on one stream. On
    # one group, with two stages, stage 0's stream would hold [send item 1, send item 2, recv logits 1]
    # and stage 1's [recv item 1, send logits 1, recv item 2]: send item 2 and send logits 1 would wait on
    # each other. With two groups each direction has its own communicator and stream, and on each one
    # the two sides post their operations in the same order (items in step order)."""

    def __init__(self, channel: StageChannel, device: torch.device) -> None:
        if not dist.is_nccl_available():
            raise RuntimeError("this torch build has no NCCL: use --stage-transport host")
        self.rank, self.world, self.device = channel.rank, channel.world, device
        self.forward = _nccl_group(channel.store, "nccl_forward", self.rank, self.world)
        self.back = _nccl_group(channel.store, "nccl_back", self.rank, self.world)
        self.pending: list[dist.Work] = []
        self._connect()

    def _connect(self) -> None:
        """Create every communicator now, in an order without cycles (stage 0 -> 1 -> ... -> last -> 0):
        NCCL creates a pair's communicator at its first send/recv, blocking both stages until both
        are there, which in the middle of a step could wait on a stage that waits on something else."""
        one = torch.zeros(1, dtype=torch.uint8, device=self.device)
        last = self.world - 1
        if self.rank > 0:
            self.recv((1,), torch.uint8, self.rank - 1)
        if self.rank < last:
            self.send(one, self.rank + 1)
        else:
            self.send(one, 0)
        if self.rank == 0:
            self.recv((1,), torch.uint8, last)
        self.flush()
        torch.cuda.synchronize(self.device)

    def _group(self, peer: int, sending: bool) -> dist.ProcessGroupNCCL:
        ahead = peer == self.rank + 1 if sending else peer == self.rank - 1
        if ahead:
            return self.forward
        last = self.world - 1
        logits = (self.rank, peer) == ((last, 0) if sending else (0, last))
        if not logits:
            raise ValueError(f"stage {self.rank} has no traffic with stage {peer}")
        return self.back

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Queued on the group's stream after the work queued so far; not waited for here (`flush`)."""
        self.pending.append(self._group(dst, True).send([_raw(t)], dst, 0))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        # NOTE: wait() makes the current stream wait for the receive; the host goes on.
        self._group(src, False).recv([_raw(buf)], src, 0).wait()
        return buf

    def flush(self) -> None:
        """The current stream waits for every send started (so the next step's writes come after)."""
        for work in self.pending:
            work.wait()
        self.pending = []

    def close(self) -> None:
        """Tear the communicators down (after the last step: nothing is in flight)."""
        for group in (self.forward, self.back):
            try:  # abort: local, never waits on a peer (which may have exited already)
                (getattr(group, "abort", None) or group.shutdown)()
            except Exception as exc:  # noqa: BLE001 - the process is ending anyway
                log.warning("NCCL group teardown: %s", exc)


def make_transport(kind: str, channel: StageChannel, device: torch.device) -> HostTransport | NcclTransport:
    """`host` and `shm` both pass activations through host memory, over the channel (Gloo, or the shared
    memory rings of shm_channel.py)."""
    return NcclTransport(channel, device) if kind == "nccl" else HostTransport(channel, device)
