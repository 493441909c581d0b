"""The pinned buffers a stage hop reuses (runtime/hop_buffers.py) and what tells them free: a channel's
`holds` (a send not yet done reads the buffer) and, on a GPU, the copy up's event (stage_transport.py)."""

import threading

import pytest
import torch

from nextserve.runtime.hop_buffers import MIN_BYTES, HopBuffers, capacity
from nextserve.runtime.shm_channel import SLOT_BYTES, SLOTS, ShmChannel
from nextserve.runtime.stage_channel import StageChannel, free_port
from nextserve.runtime.stage_transport import HostTransport


def test_capacity_is_the_next_power_of_two_from_min_bytes() -> None:
    assert capacity(0) == capacity(1) == capacity(MIN_BYTES) == MIN_BYTES
    assert capacity(MIN_BYTES + 1) == 2 * MIN_BYTES
    assert capacity(20480) == 32768 and capacity(1 << 20) == 1 << 20


def test_a_free_buffer_is_handed_out_again_and_a_busy_one_never() -> None:
    bufs = HopBuffers(pin=False, limit=2)
    i, a = bufs.take(100, lambda i: False)
    j, b = bufs.take(50, lambda i: False)
    assert (i, j) == (0, 0) and a.data_ptr() == b.data_ptr() and b.numel() == 50
    k, c = bufs.take(100, lambda i: i == 0)  # buffer 0 still read: a second one
    assert k == 1 and c.data_ptr() != a.data_ptr()
    m, d = bufs.take(100, lambda i: True)  # both kept ones busy: one for this message alone
    assert m == -1 and d.data_ptr() not in {a.data_ptr(), c.data_ptr()} and len(bufs.bufs) == 2
    n, e = bufs.take(3 * MIN_BYTES, lambda i: i == 1)  # 0 free but too small: a bigger one in its place
    assert n == 0 and bufs.bufs[0].numel() == 4 * MIN_BYTES and e.numel() == 3 * MIN_BYTES
    assert bufs.take(MIN_BYTES, lambda i: False)[0] == 0


def test_no_buffers_kept_and_a_bad_limit() -> None:
    assert HopBuffers(pin=False, limit=0).take(10, lambda i: False)[0] == -1
    with pytest.raises(ValueError, match="0 or more"):
        HopBuffers(pin=False, limit=-1)


def _two_ends(kind):
    port, ends = free_port(), [None, None]

    def make(rank: int) -> None:
        ends[rank] = kind(rank, 2, port)

    makers = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for m in makers:
        m.start()
    for m in makers:
        m.join()
    return ends


@pytest.mark.parametrize("kind", [StageChannel, ShmChannel], ids=["gloo", "shm"])
def test_reused_buffers_never_change_a_message_still_in_flight(kind) -> None:
    """HostTransport's send, the device copy left out: each message written into a buffer the channel does
    not hold, many sent before any is received (the shm rings fill, so sends queue and hold their buffers);
    every message arrives as written. With `holds` always false, the queued ones would be overwritten."""
    sender, receiver = _two_ends(kind)
    bufs = HopBuffers(pin=False)
    g = torch.Generator().manual_seed(0)
    msgs = [torch.randn(SLOT_BYTES // 4 + 1000 * i, generator=g) for i in range(3 * SLOTS)]
    try:
        for m in msgs:
            _, raw = bufs.take(m.numel() * 4, lambda i: sender.holds(bufs.bufs[i]))
            host = raw.view(torch.float32)
            host.copy_(m)
            sender.send(host, 1)
        if kind is ShmChannel:
            assert sender.holds(host)  # the last one waits for slots
        got = [torch.empty_like(m) for m in msgs]
        taker = threading.Thread(target=lambda: [receiver.recv_into(x, 0) for x in got])
        taker.start()  # (the sender's queued bytes move on only in its own calls: its flush, here)
        sender.flush()
        taker.join(timeout=60)
        assert all(torch.equal(x, m) for x, m in zip(got, msgs, strict=True))
        assert not any(sender.holds(b) for b in bufs.bufs)
    finally:
        for c in (sender, receiver):
            if hasattr(c, "close"):
                c.close()


def test_the_cpu_transport_sends_tensors_as_they_are() -> None:
    sender, receiver = _two_ends(ShmChannel)
    a, b = HostTransport(sender, torch.device("cpu")), HostTransport(receiver, torch.device("cpu"))
    t = torch.arange(12, dtype=torch.int64).view(3, 4)
    try:
        a.send(t, 1)
        assert torch.equal(b.recv((3, 4), torch.int64, 0), t) and not a.outgoing.bufs
    finally:
        sender.close(), receiver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", [StageChannel, ShmChannel], ids=["gloo", "shm"])
def test_gpu_hops_reuse_buffers_and_arrive_bit_for_bit(kind) -> None:
    """Twelve GPU tensors of changing sizes sent while another thread receives and copies them up (the shm
    rings fill, so sends queue and hold their buffers), three times over: every one arrives bit for bit, and
    the kept buffers are reused."""
    dev = torch.device("cuda")
    ends = _two_ends(kind)
    a, b = HostTransport(ends[0], dev), HostTransport(ends[1], dev)
    g = torch.Generator(device=dev).manual_seed(0)
    msgs = [torch.randn(1 + 3 * i, 2560, device=dev, generator=g).to(torch.bfloat16) for i in range(12)]
    try:
        for _ in range(3):
            got = []
            taker = threading.Thread(
                target=lambda got=got: got.extend(b.recv(m.shape, m.dtype, 0) for m in msgs)
            )
            taker.start()
            for m in msgs:
                a.send(m, 1)
            ends[0].flush()
            taker.join(timeout=60)
            torch.cuda.synchronize()
            assert len(got) == len(msgs) and all(torch.equal(x, m) for x, m in zip(got, msgs, strict=True))
        assert 0 < len(a.outgoing.bufs) <= 4 and 0 < len(b.incoming.bufs) <= 4
    finally:
        for c in ends:
            if hasattr(c, "close"):
                c.close()
