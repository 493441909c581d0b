"""Property tests of the shared KV pool, the state slots and per-sequence caches (issue 3, C2).

A model of what every owner (live sequence or image) should hold runs beside the real objects.
Every write stores values unique to (owner, position), so a page handed to two writers, or a
copy-on-write that does not copy, shows up as wrong data, not only as wrong bookkeeping."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nextserve.cache.kv_pool import KVPool, PoolExhausted
from nextserve.cache.sequence import SequenceCache, SequenceImage
from nextserve.cache.states import STATE_FIELDS, StateSlots

N_ATTN = 2  # one QSA layer and the MTP layer, as the engine sizes the pool for hf_oracle.TINY
UID_STRIDE = 4096  # markers uid * UID_STRIDE + position + 1 stay exact in float32


def kv_marker(uid: int, pos: int, layer: int) -> float:
    return uid * UID_STRIDE + pos + 1 + 0.5 * layer


def write_tokens(cache: SequenceCache, uid: int, n: int) -> None:
    """What a forward of n tokens does to a cache: KV of every layer, the block keys of the blocks
    it completes, the state slot; then the engine commits the length."""
    pool, start = cache.pool, cache.length
    c = pool.page_size // pool.blocks_per_page
    nkv, d = pool.k.shape[-2], pool.k.shape[-1]
    di = pool.block_keys.shape[-1]
    for a in range(N_ATTN):
        vals = torch.tensor([kv_marker(uid, p, a) for p in range(start, start + n)])
        k = vals[:, None, None].expand(n, nkv, d).contiguous()
        cache.write_kv(a, start, k, -k)
        first, end = start // c, (start + n) // c
        if end > first:
            keys = torch.tensor([kv_marker(uid, b, a) for b in range(first, end)])
            cache.write_block_keys(a, first, keys[:, None].expand(end - first, di).contiguous())
    for name in STATE_FIELDS:
        getattr(cache.slots, name)[:, cache.slot].fill_(uid * UID_STRIDE + start + n)
    cache.length = start + n


def image_view(pool: KVPool, image: SequenceImage, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    table = torch.tensor(image.pages, dtype=torch.long)
    c = pool.page_size // pool.blocks_per_page
    k = pool.k[layer, table].flatten(0, 1)[: image.length]
    bk = pool.block_keys[layer, table].flatten(0, 1)[: image.length // c]
    return k, bk


def release_image(pool: KVPool, image: SequenceImage) -> None:
    """What the image store does when it drops an image: any cache of the pool can release it."""
    SequenceCache.release_image(SimpleNamespace(pool=pool), image)


@dataclass
class Owner:
    """What one sequence or image should hold: per position the uid that wrote it, per block too."""

    kv: list[int] = field(default_factory=list)  # writer uid of each position < length
    blocks: list[int] = field(default_factory=list)  # writer uid of each complete block
    state: int = 0  # the slot's fill value (0: freshly reset)

    def copy(self) -> Owner:
        return Owner(list(self.kv), list(self.blocks), self.state)


@dataclass
class Live:
    cache: SequenceCache
    uid: int
    reserved: int
    want: Owner


class PoolMachine(RuleBasedStateMachine):
    """Random interleavings of admit, extend, compute, snapshot, restore, finish, abort."""

    cfg = None  # set by the test (a session fixture)

    @initialize(
        page_blocks=st.integers(1, 2),
        num_pages=st.integers(1, 16),
        num_slots=st.integers(1, 4),
    )
    def setup(self, page_blocks: int, num_pages: int, num_slots: int) -> None:
        c = self.cfg.indexer_compress_ratio
        self.pool = KVPool(self.cfg, N_ATTN, num_pages, c * page_blocks, torch.float32)
        self.slots = StateSlots(self.cfg, num_slots, N_ATTN, torch.float32)
        self.live: list[Live] = []
        self.images: list[tuple[SequenceImage, Owner]] = []
        self.next_uid = 1

    # ---- helpers -------------------------------------------------------------------------------
    def _uid(self) -> int:
        self.next_uid += 1
        return self.next_uid

    def _books(self) -> tuple:
        return (list(self.pool.refcount), list(self.pool._free), list(self.slots._free))

    # ---- rules ---------------------------------------------------------------------------------
    @precondition(lambda self: self.slots.num_free > 0)
    @rule(tokens=st.integers(1, 32))
    def admit(self, tokens: int) -> None:
        free_before = self.pool.num_free
        cache = SequenceCache(self.pool, self.slots)
        if self.pool.pages_for(tokens) > free_before:
            before = self._books()
            with pytest.raises(PoolExhausted):
                cache.reserve(tokens)
            assert self._books() == before  # all or nothing
            cache.free()  # the scheduler would not have admitted it: the slot goes back
            return
        cache.reserve(tokens)
        assert self.pool.num_free == free_before - self.pool.pages_for(tokens)
        self.live.append(Live(cache, self._uid(), tokens, Owner()))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), more=st.integers(1, 24))
    def extend(self, i: int, more: int) -> None:
        s = self.live[i % len(self.live)]
        target = s.reserved + more
        need = s.cache.pages_needed(target)
        if need > self.pool.num_free:
            before = self._books()
            with pytest.raises(PoolExhausted):
                s.cache.reserve(target)
            assert self._books() == before
            return
        free_before = self.pool.num_free
        s.cache.reserve(target)
        assert self.pool.num_free == free_before - need
        s.reserved = target

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), n=st.integers(1, 20))
    def compute(self, i: int, n: int) -> None:
        s = self.live[i % len(self.live)]
        n = min(n, s.reserved - s.cache.length)
        if n <= 0:
            return
        free_before = self.pool.num_free
        start = s.cache.length
        write_tokens(s.cache, s.uid, n)
        # NOTE: an admitted sequence's writes stay inside its reservation: a forward never allocates.
        assert self.pool.num_free == free_before
        c = self.cfg.indexer_compress_ratio
        s.want.kv += [s.uid] * n
        s.want.blocks += [s.uid] * ((start + n) // c - start // c)
        s.want.state = s.uid * UID_STRIDE + start + n

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def snapshot(self, i: int) -> None:
        s = self.live[i % len(self.live)]
        partial = s.cache.length % self.pool.page_size != 0
        if partial and self.pool.num_free == 0:
            before = self._books()
            with pytest.raises(PoolExhausted):
                s.cache.snapshot()
            assert self._books() == before
            return
        image = s.cache.snapshot()
        assert image.length == s.cache.length
        assert len(image.pages) == self.pool.pages_for(image.length)
        self.images.append((image, s.want.copy()))

    @precondition(lambda self: self.images and self.slots.num_free > 0)
    @rule(j=st.integers(0, 99), extra=st.integers(0, 24))
    def restore_new(self, j: int, extra: int) -> None:
        """A new request resumes from an image (prefix reuse), then reserves what it will write."""
        image, want = self.images[j % len(self.images)]
        cache = SequenceCache(self.pool, self.slots)
        cache.restore(image)
        self._reserve_after_restore(cache, image, want, extra)

    @precondition(lambda self: self.images and self.live)
    @rule(i=st.integers(0, 99), j=st.integers(0, 99), extra=st.integers(0, 24))
    def restore_live(self, i: int, j: int, extra: int) -> None:
        """A live sequence drops what it holds and becomes the image's sequence."""
        s = self.live.pop(i % len(self.live))
        image, want = self.images[j % len(self.images)]
        s.cache.restore(image)
        self._reserve_after_restore(s.cache, image, want, extra)

    def _reserve_after_restore(self, cache: SequenceCache, image, want: Owner, extra: int) -> None:
        assert cache.length == image.length
        target = image.length + extra
        if cache.pages_needed(target) > self.pool.num_free:
            with pytest.raises(PoolExhausted):
                cache.reserve(target)
            cache.free()  # not admitted
            return
        cache.reserve(target)
        self.live.append(Live(cache, self._uid(), max(target, image.length), want.copy()))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def finish(self, i: int) -> None:
        s = self.live.pop(i % len(self.live))
        slot = s.cache.slot
        s.cache.free()
        assert slot in self.slots._free and s.cache.block_table == [] and s.cache.slot is None
        s.cache.free()  # a second finish (abort after finish) is harmless

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), n=st.integers(0, 8))
    def abort_mid_prefill(self, i: int, n: int) -> None:
        """Some of the prompt written, then the client goes away: everything returns at once."""
        s = self.live.pop(i % len(self.live))
        n = min(n, s.reserved - s.cache.length)
        if n > 0:
            write_tokens(s.cache, s.uid, n)
        owned = [p for p in s.cache.block_table if self.pool.refcount[p] == 1]
        free_before, slots_before = self.pool.num_free, self.slots.num_free
        s.cache.free()
        assert self.pool.num_free == free_before + len(owned)
        assert self.slots.num_free == slots_before + 1

    @precondition(lambda self: self.images)
    @rule(j=st.integers(0, 99))
    def release_image(self, j: int) -> None:
        image, _ = self.images.pop(j % len(self.images))
        release_image(self.pool, image)
        assert image.released
        release_image(self.pool, image)  # twice is harmless

    # ---- invariants ----------------------------------------------------------------------------
    @invariant()
    def books_balance(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool, P = self.pool, self.pool.page_size
        refs = Counter()
        for s in self.live:
            refs.update(s.cache.block_table)
            assert len(set(s.cache.block_table)) == len(s.cache.block_table)
        for image, _ in self.images:
            refs.update(image.pages)
        assert [pool.refcount[p] for p in range(pool.num_pages)] == [refs[p] for p in range(pool.num_pages)]
        assert len(set(pool._free)) == len(pool._free)
        assert set(pool._free) == {p for p in range(pool.num_pages) if refs[p] == 0}
        assert pool.num_free + sum(1 for p in range(pool.num_pages) if refs[p]) == pool.num_pages
        # NOTE: a page is shared only read-only: every page a live sequence may still write (from its
        # length's page up to its reservation) is its own.
        for s in self.live:
            if s.reserved > s.cache.length:
                for idx in range(s.cache.length // P, pool.pages_for(s.reserved)):
                    assert pool.refcount[s.cache.block_table[idx]] == 1, (idx, s.cache.block_table)
        live_slots = [s.cache.slot for s in self.live]
        assert len(set(live_slots)) == len(live_slots)
        assert not set(live_slots) & set(self.slots._free)
        assert len(set(self.slots._free)) == len(self.slots._free)
        assert len(live_slots) + self.slots.num_free == self.slots.num_slots

    @invariant()
    def data_intact(self) -> None:
        if not hasattr(self, "pool"):
            return
        c = self.cfg.indexer_compress_ratio
        owners = [(s.cache.read_kv, s.cache.read_block_keys, s.cache.length, s.want) for s in self.live]
        for s in self.live:
            for name in STATE_FIELDS:
                got = getattr(self.slots, name)[:, s.cache.slot]
                if name == "ple_ctx" and s.want.state == 0:
                    assert (got == self.cfg.eos_token_id).all()  # reset: an eos context
                else:
                    assert (got == s.want.state).all(), name
        for image, want in self.images:
            assert all(
                (t == want.state).all() for n, t in image.state.items() if want.state or n != "ple_ctx"
            )
            owners.append(
                (
                    lambda a, n, im=image: image_view(self.pool, im, a)[0][:n],
                    lambda a, n, im=image: image_view(self.pool, im, a)[1][:n],
                    image.length,
                    want,
                )
            )
        for read_kv, read_bk, length, want in owners:
            assert len(want.kv) == length and len(want.blocks) == length // c
            for a in range(N_ATTN):
                expect = torch.tensor([kv_marker(u, p, a) for p, u in enumerate(want.kv)])
                k = read_kv(a, length)
                k = k[0] if isinstance(k, tuple) else k
                assert torch.equal(k[:, 0, 0], expect), (a, k[:, 0, 0], expect)
                if length // c:
                    expect_b = torch.tensor([kv_marker(u, b, a) for b, u in enumerate(want.blocks)])
                    assert torch.equal(read_bk(a, length // c)[:, 0], expect_b)

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for s in self.live:
            s.cache.free()
        for image, _ in self.images:
            release_image(self.pool, image)
        assert self.pool.num_free == self.pool.num_pages
        assert all(r == 0 for r in self.pool.refcount)
        assert self.slots.num_free == self.slots.num_slots


def test_pool_interleavings(oracle_config) -> None:
    PoolMachine.cfg = oracle_config
    runner = PoolMachine.TestCase
    runner.settings = settings(
        max_examples=200,
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    runner().runTest()


# ---- directed cases ----------------------------------------------------------------------------
def _pool(cfg, pages: int, page_size: int = 8, slots: int = 4) -> tuple[KVPool, StateSlots]:
    return KVPool(cfg, N_ATTN, pages, page_size, torch.float32), StateSlots(cfg, slots, N_ATTN, torch.float32)


def test_copy_on_write_copies(oracle_config) -> None:
    """Writing into a restored sequence (and into the sequence the image came from) leaves the
    image's pages untouched; a second restore of the image sees the original data."""
    pool, slots = _pool(oracle_config, pages=12)
    a = SequenceCache(pool, slots)
    a.reserve(24)
    write_tokens(a, 1, 10)  # position 10 sits inside page 1: the image's last page is partly filled
    image = a.snapshot()
    saved_k = pool.k[:, image.pages].clone()
    saved_bk = pool.block_keys[:, image.pages].clone()
    assert a.block_table[:1] == image.pages[:1] and a.block_table[1] != image.pages[1]

    b = SequenceCache(pool, slots)
    b.restore(image)
    assert b.block_table == image.pages and pool.refcount[image.pages[0]] == 3
    b.reserve(20)
    assert b.block_table[0] == image.pages[0]  # full page below the length: still shared
    assert b.block_table[1] != image.pages[1]  # the page it writes: its own copy
    write_tokens(b, 2, 10)
    write_tokens(a, 3, 14)
    assert torch.equal(pool.k[:, image.pages], saved_k)
    assert torch.equal(pool.block_keys[:, image.pages], saved_bk)
    # b still reads the image's first 10 positions, then its own
    k, _ = b.read_kv(0, 20)
    assert k[:, 0, 0].tolist() == [kv_marker(1, p, 0) for p in range(10)] + [
        kv_marker(2, p, 0) for p in range(10, 20)
    ]
    # the copied page kept the image's positions 8, 9
    assert pool.k[0, b.block_table[1], :2, 0, 0].tolist() == [kv_marker(1, 8, 0), kv_marker(1, 9, 0)]

    c = SequenceCache(pool, slots)
    c.restore(image)
    for name in STATE_FIELDS:
        assert torch.equal(getattr(slots, name)[:, c.slot], image.state[name])
    k, _ = c.read_kv(1, 10)
    assert k[:, 0, 0].tolist() == [kv_marker(1, p, 1) for p in range(10)]
    for s in (a, b, c):
        s.free()
    a.release_image(image)
    assert pool.num_free == pool.num_pages and slots.num_free == slots.num_slots


def test_writes_after_snapshot_stay_in_the_reservation(oracle_config) -> None:
    """A sequence admitted with its whole reservation is never cut short, even when an image of it
    was taken mid-page and others then fill the pool (C2)."""
    pool, slots = _pool(oracle_config, pages=4)
    a = SequenceCache(pool, slots)
    a.reserve(24)  # 3 pages
    write_tokens(a, 1, 10)
    image = a.snapshot()  # takes the 4th page (a's copy of the partly filled page 1)
    assert pool.num_free == 0
    write_tokens(a, 1, 14)  # up to its reservation, with no page free
    assert pool.num_free == 0
    a.free()
    a.release_image(image)
    assert pool.num_free == pool.num_pages


def test_snapshot_without_a_free_page_refuses_cleanly(oracle_config) -> None:
    pool, slots = _pool(oracle_config, pages=2)
    a = SequenceCache(pool, slots)
    a.reserve(16)
    write_tokens(a, 1, 10)
    with pytest.raises(PoolExhausted):
        a.snapshot()
    assert pool.refcount == [1, 1]
    write_tokens(a, 1, 6)
    image = a.snapshot()  # page aligned: nothing to split, nothing to allocate
    assert image.pages == a.block_table and pool.refcount == [2, 2]
    a.free()
    a.release_image(image)
    assert pool.num_free == 2


def test_restore_reservation_is_all_or_nothing(oracle_config) -> None:
    pool, slots = _pool(oracle_config, pages=5)
    a = SequenceCache(pool, slots)
    a.reserve(10)
    write_tokens(a, 1, 10)
    image = a.snapshot()
    a.free()
    b = SequenceCache(pool, slots)
    b.restore(image)
    assert b.pages_needed(10) == 0  # nothing to write
    assert b.pages_needed(16) == 1  # the partly filled page is copied
    assert b.pages_needed(17) == 2
    before = list(pool.refcount), list(b.block_table)
    with pytest.raises(PoolExhausted):
        b.reserve(40)  # 3 new pages and one copy; 3 free
    assert (list(pool.refcount), list(b.block_table)) == before
    b.reserve(32)  # 2 new pages and the copy
    assert pool.num_free == 0
    write_tokens(b, 2, 22)
    b.free()
    b.release_image(image)
    assert pool.num_free == pool.num_pages


def test_slots_reset_and_never_double_handed(oracle_config) -> None:
    pool, slots = _pool(oracle_config, pages=2, slots=2)
    a, b = SequenceCache(pool, slots), SequenceCache(pool, slots)
    assert a.slot != b.slot and slots.num_free == 0
    with pytest.raises(RuntimeError):
        SequenceCache(pool, slots)
    a.reserve(3)
    write_tokens(a, 1, 3)
    a.free()
    c = SequenceCache(pool, slots)  # reuses a's slot: reset to the state before position 0
    assert c.slot is not None
    for name in STATE_FIELDS:
        t = getattr(slots, name)[:, c.slot]
        assert (t == (oracle_config.eos_token_id if name == "ple_ctx" else 0)).all(), name
    b.free()
    with pytest.raises(AssertionError):
        slots.release(c.slot) or slots.release(c.slot)  # a double free is caught, not absorbed
