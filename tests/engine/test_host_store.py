"""The host image store (DESIGN.md section 2): prefix images the device spills are kept in host
memory and brought back when a prompt resumes from them, giving exactly a cold run's tokens and
logprobs (C1); every page returns to the pool (C2)."""

import pytest
import torch
from test_prefix_reuse import GREEDY, SEEDED, _ids, _pool_full_after_clear, _run, _same

from nextserve.cache.host_store import HostImage, HostImageStore
from nextserve.cache.pinned_arena import ALIGN, PinnedArena
from nextserve.config import ConfigError
from nextserve.engine_config import EngineConfig

ONE_ON_DEVICE = dict(prefix_cache_images=1, host_state_slots=4)


def test_a_spilled_image_resumes_exactly(oracle_llm, solo_run) -> None:
    llm = oracle_llm(**ONE_ON_DEVICE)
    a, b = _ids(70, 11), _ids(70, 12)
    _run(llm, a, GREEDY)  # image of a[:64] on the device
    _run(llm, b, GREEDY)  # b's image takes the one device place: a's goes to the host
    s = llm.stats()
    assert (s["prefix_images"], s["host_images"]) == (1, 1)
    prompt = a + _ids(20, 13)
    # First from a's image brought back from the host (64), then from the prompt's own (90 -> 80).
    for params, cached, hits in ((GREEDY, 64, 1), (SEEDED, 80, 1)):
        out = _run(llm, prompt, params)
        assert out.cached_tokens == cached and llm.stats()["host_image_hits"] == hits
        _same(out, solo_run(prompt, params))
    _pool_full_after_clear(llm)
    assert llm.stats()["host_images"] == 0


def test_without_pages_to_bring_it_back_the_prompt_runs_cold(oracle_llm, solo_run) -> None:
    """A host image needs free pages to come back; without them the prompt prefills cold, exactly."""
    llm = oracle_llm(**ONE_ON_DEVICE)
    a = _ids(70, 21)
    _run(llm, a, GREEDY)
    _run(llm, _ids(70, 22), GREEDY)
    pool = llm.engine.pool
    held = pool.alloc(pool.num_free)  # nothing left to copy the image into
    try:
        image = llm.engine.prefix.lookup(a + [5])
        assert image is None and llm.stats()["host_images"] == 1
    finally:
        pool.release(held)
    out = _run(llm, a + [5, 6], GREEDY)
    _same(out, solo_run(a + [5, 6], GREEDY))
    _pool_full_after_clear(llm)


def _host_image(nbytes_rows: int) -> HostImage:
    z, no_pages = torch.zeros(nbytes_rows, dtype=torch.uint8), torch.zeros(1, 0, dtype=torch.uint8)
    return HostImage(64, {"s": z}, [no_pages, no_pages, no_pages])


def test_store_bounds_images_and_bytes_lru() -> None:
    store = HostImageStore(max_images=2, max_bytes=250)
    store.put(b"a", (1,), _host_image(100))
    store.put(b"b", (2,), _host_image(100))
    assert store.get(b"a", (1,)) is not None  # a is now the most recently used
    store.put(b"c", (3,), _host_image(100))  # over 2 images: b (least recent) goes
    assert store.get(b"b", (2,)) is None and len(store) == 2 and store.nbytes == 200
    store.put(b"d", (4,), _host_image(200))  # over 250 bytes: a and c go
    assert len(store) == 1 and store.nbytes == 200
    store.put(b"e", (5,), _host_image(300))  # larger than the whole store: not kept
    assert store.get(b"e", (5,)) is None and store.get(b"d", (4,)) is not None
    assert store.get(b"d", (9,)) is None  # the tokens are compared, not only the key


def test_host_store_needs_the_prefix_cache() -> None:
    with pytest.raises(ConfigError, match="prefix_cache_images"):
        EngineConfig(prefix_cache_images=0, host_state_slots=2)
    with pytest.raises(ConfigError, match="prefix reuse on"):
        EngineConfig(prefix_cache=False, host_state_slots=2)
    EngineConfig(prefix_cache=False)  # host_state_slots auto: off with prefix reuse
    with pytest.raises(ConfigError, match="host_kv_mib"):
        EngineConfig(prefix_cache_images=2, host_state_slots=2, host_kv_mib=-1)


def test_images_in_a_full_host_arena_take_the_regions_of_dropped_ones(oracle_llm, solo_run) -> None:
    """The store's copies carved from a host arena (plain memory here; pinned on a GPU) with room for two
    or three images: each spill past that drops the least recently used image (the arena's reclaim) and
    takes its region; nothing is allocated apart, and resumes stay exact."""
    llm = oracle_llm(prefix_cache_images=1, host_state_slots=16)
    eng = llm.engine
    one = eng.pool.pages_for(64) * eng.pool.page_bytes + eng.slots.slot_nbytes
    arena = PinnedArena(
        0, buffer=torch.zeros(-(-5 * one // 2 // ALIGN) * ALIGN + 2 * ALIGN, dtype=torch.uint8)
    )
    eng.pool.host_arena, arena.reclaim = arena, eng.prefix.host.evict_lru
    bases = [_ids(70, 40 + i) for i in range(5)]
    for base in bases:
        _run(llm, base, GREEDY)
        images = [img for _, img in eng.prefix.host._entries.values()]
        assert all(img.region is not None for img in images)
        assert arena.used == sum(img.region.nbytes for img in images)
        del images  # (a reference here would keep a dropped image's region)
    assert 1 <= len(eng.prefix.host) <= 3
    for base in reversed(bases):
        prompt = base + [5, 6]
        _same(_run(llm, prompt, GREEDY), solo_run(prompt, GREEDY))
    assert llm.stats()["host_image_hits"] >= 1
    _pool_full_after_clear(llm)
    assert arena.used == 0
