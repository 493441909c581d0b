"""Stage traffic through shared memory (`--stage-transport shm`, stages on one machine): the StageChannel
calls (tensors, step messages) over one-writer, one-reader rings in /dev/shm (shm_ring.py), one ring per
ordered pair of stages and tag; the Gloo group stays for start-up (and `broadcast`), off the per-token path.

A send copies what fits into free slots at once and queues the rest; every later call that waits (a receive,
`flush`) first moves queued bytes on, so two stages sending to each other never wait on each other (the
Gloo channel's sends were asynchronous for the same reason: stage_channel.py). A wait that sees its peer
process gone (or a zombie) raises within `LIVENESS_S`, as a closed Gloo socket did.

# NOTE: no file is left in /dev/shm: each stage creates the rings it writes, every stage maps every ring it
# reads, and once all have (a store barrier) each unlinks its own: the memory lives until the last mapping
# goes, with the processes, however they end. Only a process killed inside that start-up barrier leaves its
# files (an atexit hook removes them on any exit Python sees).
"""

from __future__ import annotations

import atexit
import collections
import os
import time
import uuid
from pathlib import Path

import torch

from . import stage_codec
from .shm_ring import ShmRing, ring_bytes
from .stage_channel import STEP_TAG, TIMEOUT, StageChannel, reads_from

SHM_DIR = "/dev/shm"
SLOTS = 4  # slots a ring: a sender runs up to this many slots ahead of its reader
SLOT_BYTES = 256 * 1024  # a tensor ring's slot: one decode hop at the released widths up to 12 rows
STEP_SLOT_BYTES = 64 * 1024  # a step-message ring's slot

LIVENESS_S = 0.05  # how often a wait looks at its peer process
# NOTE: a wait polls, yielding the core between polls (sched_yield: at once when nothing else is runnable),
# for SPIN_S, then sleeps SLEEP_S between polls. A sleep is at least the kernel's 50 us timer slack, which
# a hop would pay; a stage waits on its neighbour's forward (milliseconds), so the spin covers that.
SPIN_S = 0.02
SLEEP_S = 0.0001


def process_alive(pid: int) -> bool:
    """Whether process pid runs (a zombie, killed and not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


class ShmChannel(StageChannel):
    def __init__(self, rank: int, world: int, port: int = 0, store=None) -> None:
        super().__init__(rank, world, port, store)
        self.out: dict[tuple[int, int], ShmRing] = {}
        self.inn: dict[tuple[int, int], ShmRing] = {}
        self.queued: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self.pids: dict[int, int] = {}
        self.backlog = 0  # messages queued (not yet all in slots), over every ring
        self._connect()

    @staticmethod
    def bytes_needed(world: int) -> int:
        """The shared memory the rings of `world` stages take at most (all their slots written)."""
        size = {0: ring_bytes(SLOTS, SLOT_BYTES), STEP_TAG: ring_bytes(SLOTS, STEP_SLOT_BYTES)}
        return sum(size[tag] for _, _, tag in ShmChannel._pairs(world))

    @staticmethod
    def _pairs(world: int) -> list[tuple[int, int, int]]:
        """(src, dst, tag) of every ring: tensors between any two stages, step messages from stage 0."""
        pairs = [(s, d, 0) for s in range(world) for d in range(world) if s != d]
        return pairs + [(0, d, STEP_TAG) for d in range(1, world)]

    def _connect(self) -> None:
        s, r, world = self.store, self.rank, self.world
        if r == 0:
            s.set("shm/token", uuid.uuid4().hex[:16])
        token = s.get("shm/token").decode()
        s.set(f"shm/pid/{r}", str(os.getpid()))
        self.pids = {q: int(s.get(f"shm/pid/{q}")) for q in range(world)}

        def path(src: int, dst: int, tag: int) -> Path:
            return Path(SHM_DIR) / f"nextserve-{token}-{src}-{dst}-{tag}"

        def size(tag: int) -> int:
            return STEP_SLOT_BYTES if tag == STEP_TAG else SLOT_BYTES

        mine = [p for p in self._pairs(world) if p[0] == r]
        made = [path(*p) for p in mine]

        def cleanup() -> None:
            _unlink(made)

        atexit.register(cleanup)
        for src, dst, tag in mine:
            self.out[dst, tag] = ShmRing(path(src, dst, tag), SLOTS, size(tag), create=True)
        s.set(f"shm/made/{r}", "1")
        s.wait([f"shm/made/{q}" for q in range(world)])
        for src, dst, tag in self._pairs(world):
            if dst == r:
                self.inn[src, tag] = ShmRing(path(src, dst, tag), SLOTS, size(tag), create=False)
        s.set(f"shm/mapped/{r}", "1")
        s.wait([f"shm/mapped/{q}" for q in range(world)])
        cleanup()
        atexit.unregister(cleanup)

    # ---- moving bytes ----------------------------------------------------------------------------------
    def _progress(self) -> None:
        """Copy queued sends into whatever slots are free, in order per ring; never waits."""
        if not self.backlog:
            return
        for key, queue in self.queued.items():
            ring = self.out[key]
            while queue and ring.free_slots() > 0:
                data, off = queue[0]
                n = min(ring.slot_bytes, data.numel() - off)
                ring.put_chunk(data.data_ptr() + off, n)
                if off + n == data.numel():
                    queue.popleft()
                    self.backlog -= 1
                else:
                    queue[0] = (data, off + n)

    def _wait(self, ready, peer: int) -> None:
        """Until ready(), moving queued sends on; a RuntimeError once `peer`'s process is gone."""
        start = time.monotonic()
        check, spin_until = start + LIVENESS_S, start + SPIN_S
        while True:
            self._progress()
            if ready():
                return
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()
            else:
                time.sleep(SLEEP_S)
            if now >= check:
                if not process_alive(self.pids[peer]):
                    raise RuntimeError(f"pipeline stage {peer} is gone (process {self.pids[peer]})")
                if now - start > TIMEOUT.total_seconds():
                    raise RuntimeError(f"pipeline stage {peer} stopped answering")
                check = now + LIVENESS_S

    def _send(self, data: torch.Tensor, dst: int, tag: int) -> None:
        """data: contiguous uint8 on the CPU, kept (queued) until its last byte is in a slot."""
        n = data.numel()
        if not n:
            return
        ring = self.out[dst, tag]
        if not self.queued[dst, tag] and n <= ring.slot_bytes and ring.free_slots() > 0:
            ring.put_chunk(data.data_ptr(), n)  # the usual hop: one slot, free
            return
        self.queued[dst, tag].append((data, 0))
        self.backlog += 1
        self._progress()

    def _recv_into(self, raw: torch.Tensor, src: int, tag: int) -> None:
        """raw: contiguous uint8 on the CPU."""
        ring, off, addr, n = self.inn[src, tag], 0, raw.data_ptr(), raw.numel()
        while off < n:
            if ring.ready_slots() <= 0:
                self._wait(lambda: ring.ready_slots() > 0, src)
            off += ring.get_chunk(addr + off, n - off)

    # ---- StageChannel's calls --------------------------------------------------------------------------
    def send(self, t: torch.Tensor, dst: int) -> None:
        self._send(t.contiguous().view(torch.uint8).flatten(), dst, 0)

    def flush(self) -> None:
        if not self.backlog:
            return
        for (dst, _), queue in list(self.queued.items()):
            self._wait(lambda q=queue: not q, dst)

    def reap(self) -> None:
        self._progress()

    def send_step(self, obj: object) -> None:
        data = torch.frombuffer(bytearray(stage_codec.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long).view(torch.uint8)
        for dst in range(1, self.world):
            self._send(size, dst, STEP_TAG)
            self._send(data, dst, STEP_TAG)

    def recv_step(self) -> object:
        size = torch.zeros(1, dtype=torch.long)
        self._recv_into(size.view(torch.uint8), 0, STEP_TAG)
        buf = torch.empty(int(size[0]), dtype=torch.uint8)
        self._recv_into(buf, 0, STEP_TAG)
        return stage_codec.loads(buf.numpy().tobytes())

    def recv_into(self, t: torch.Tensor, src: int) -> None:
        self._recv_into(t.view(torch.uint8).flatten(), src, 0)

    def holds(self, t: torch.Tensor) -> bool:
        if not self.backlog:  # (every byte sent so far is in a slot)
            return False
        return any(reads_from(data, t) for queue in self.queued.values() for data, _ in queue)

    def close(self) -> None:
        self.queued.clear()
        self.backlog = 0
        for ring in [*self.out.values(), *self.inn.values()]:
            ring.close()
        self.out, self.inn = {}, {}


def _unlink(paths: list[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)
