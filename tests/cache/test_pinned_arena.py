"""The pinned host arena (cache/pinned_arena.py): regions carved first fit, given back when freed once
their copies have passed, merged with free neighbours, and `reclaim` asked when nothing fits. On the CPU
the arena is plain host memory and the copies' events are stand-ins."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nextserve.cache.pinned_arena import ALIGN, PinnedArena, region_bytes


class _Event:
    """A copy's event: passed once `done`, or once waited for."""

    def __init__(self, done: bool = False) -> None:
        self.done, self.waited = done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = self.waited = True


def _arena(pages: int) -> PinnedArena:
    return PinnedArena(0, buffer=torch.zeros(pages * ALIGN, dtype=torch.uint8))


def test_regions_are_disjoint_views_that_hold_their_tensors() -> None:
    arena = _arena(4)
    shapes = [(torch.Size([3, 5]), torch.float32), (torch.Size([7]), torch.bfloat16)]
    a, b = arena.alloc(region_bytes(shapes)), arena.alloc(region_bytes(shapes))
    ta = [a.take(s, d) for s, d in shapes]
    tb = [b.take(s, d) for s, d in shapes]
    for t in ta:
        t.fill_(1)
    for t in tb:
        t.fill_(2)
    assert all(bool((t == 1).all()) for t in ta) and all(bool((t == 2).all()) for t in tb)
    assert (ta[1].data_ptr() - arena.buffer.data_ptr()) % 256 == 0
    assert ta[0].shape == (3, 5) and ta[1].dtype == torch.bfloat16
    assert arena.used == 2 * ALIGN and arena.free_bytes == 2 * ALIGN


def test_a_full_arena_says_none_and_a_freed_region_comes_back_merged() -> None:
    arena = _arena(4)
    regions = [arena.alloc(ALIGN) for _ in range(4)]
    assert all(r is not None for r in regions) and arena.alloc(1) is None
    assert arena.alloc(5 * ALIGN) is None  # larger than the arena
    del regions[1:3]  # two neighbours in the middle
    whole = arena.alloc(2 * ALIGN)  # one range again
    assert whole is not None and whole.offset == ALIGN
    del whole, regions
    assert arena.used == 0 and arena.alloc(4 * ALIGN) is not None  # all merged into one


def test_a_region_comes_back_only_after_its_copies() -> None:
    arena = _arena(1)
    r = arena.alloc(ALIGN)
    write, read = _Event(), _Event()
    r.events += [write, read]
    del r
    assert arena.free_bytes == 0  # pending: its copies may still touch it
    again = arena.alloc(ALIGN)  # nothing else fits: waits for them
    assert again is not None and write.waited and read.waited
    done = _Event(done=True)
    again.events.append(done)
    del again
    assert arena.alloc(ALIGN) is not None and not done.waited  # passed already: no wait


def test_reclaim_is_asked_until_a_region_fits() -> None:
    arena = _arena(3)
    held = [arena.alloc(ALIGN) for _ in range(3)]
    asked = []

    def reclaim() -> bool:
        asked.append(len(held))
        if not held:
            return False
        held.pop(0)  # the owner drops its least recently used copy
        return True

    arena.reclaim = reclaim
    got = arena.alloc(2 * ALIGN)
    assert got is not None and asked == [3, 2] and len(held) == 1
    assert arena.alloc(2 * ALIGN) is None and not held  # everything reclaimed, still no room


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGN)), min_size=1, max_size=40))
def test_free_and_held_ranges_always_tile_the_arena(ops) -> None:
    arena = _arena(16)
    held = []
    for alloc, n in ops:
        if alloc or not held:
            r = arena.alloc(n)
            if r is not None:
                assert r.nbytes >= n
                held.append(r)
            del r  # (a region is freed when its last reference goes)
        else:
            held.pop(n % len(held))
        arena._collect(wait=False)  # what came back
        spans = sorted([(r.offset, r.nbytes) for r in held] + list(arena._free))
        at = 0
        for offset, size in spans:
            assert offset == at and size > 0
            at += size
        assert at == arena.nbytes and arena.used == sum(r.nbytes for r in held)
