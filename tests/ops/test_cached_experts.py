"""Routed experts with a device cache (ops/cached_experts.py): whatever the cache holds, the expert ops give
the bits of the experts read from host memory alone (C1), in every weight format, on the torch path and the
grouped kernels (decode, prefill, chunks); routing is counted; bad caches are refused."""

from __future__ import annotations

import pytest
import torch
from triton_interp import DEV, small

from nextserve.ops.cached_experts import CachedExperts, empty_like_slots, expert_bytes, parts
from nextserve.ops.fp8 import Fp8Weight, quantize
from nextserve.ops.int4 import quantize_int4
from nextserve.ops.moe import experts, experts_of_chunks, route

E, H, I, K_TOP = 8, 256, 128, 2
DTYPE = torch.float32


def _stack(fmt: str, *shape: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) / shape[-1] ** 0.5
    if fmt == "fp8":
        return Fp8Weight(*(t.to(DEV) for t in quantize(w)))
    if fmt == "int4":
        q = quantize_int4(w, 64, DTYPE)
        return type(q)(q.packed.to(DEV), q.scale.to(DEV), None, q.k)
    return w.to(device=DEV, dtype=DTYPE)


def _cached(w, slot: torch.Tensor, slots: int) -> CachedExperts:
    """w with a cache of `slots` slots holding the experts `slot` names (a copy of each)."""
    cache = empty_like_slots(w, slots, torch.device(DEV))
    for t in parts(cache):
        t.fill_(7)  # (an empty slot's bytes are never read)
    for e, c in enumerate(slot.tolist()):
        if c >= 0:
            for src, dst in zip(parts(w), parts(cache), strict=True):
                dst[c].copy_(src[e])
    counts = torch.zeros(2, E + 1, dtype=torch.int32, device=DEV)
    return CachedExperts(w, cache, slot.to(device=DEV, dtype=torch.int32), counts)


SLOTS = {  # a slot table for each case: none cached, some, all
    "none": [-1] * E,
    "some": [2, -1, -1, 0, -1, 1, -1, -1],
    "all": [7, 6, 5, 4, 3, 2, 1, 0],
}


def _problem(fmt: str, held: str, seed: int):
    gu, dn = _stack(fmt, E, 2 * I, H, seed=seed), _stack(fmt, E, H, I, seed=seed + 1)
    slot = torch.tensor(SLOTS[held])
    cgu, cdn = _cached(gu, slot, E), _cached(dn, slot, E)
    cdn = CachedExperts(cdn.host, cdn.cache, cgu.slot, cgu.counts)  # one slot table a layer
    g = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(6, H, generator=g).to(device=DEV, dtype=DTYPE)
    w, ids = route(torch.randn(6, E, generator=g).to(device=DEV, dtype=DTYPE), K_TOP, True)
    return (gu, dn), (cgu, cdn), (x, w, ids), slot


def _spoil_cached(stacks, slot: torch.Tensor) -> None:
    """Scramble the host copy of every expert that has a slot (its bytes reversed)."""
    for t in [p for w in stacks for p in parts(w)]:
        for e in torch.nonzero(slot >= 0).flatten().tolist():
            t[e] = t[e].view(torch.uint8).flip(-1).view(t.dtype)


@small
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4"])
@pytest.mark.parametrize("held", list(SLOTS))
def test_the_grouped_kernels_read_cached_experts_from_their_slots(fmt, held):
    from nextserve.ops.triton.moe_grouped import grouped_decode_experts, grouped_experts

    (gu, dn), (cgu, cdn), (x, w, ids), slot = _problem(fmt, held, seed=1)
    kernels = (grouped_decode_experts, grouped_experts)
    want = [k(x, w, ids, gu, dn) for k in kernels]
    for k, y in zip(kernels, want, strict=True):
        assert torch.equal(k(x, w, ids, cgu, cdn), y), k.__name__
    _spoil_cached((gu, dn), slot)  # a cached expert is read from its slot: the result stays
    for k, y in zip(kernels, want, strict=True):
        assert torch.equal(k(x, w, ids, cgu, cdn), y), k.__name__
    if held != "none":  # (and the spoiling shows where an expert is read from host memory)
        assert not torch.equal(grouped_decode_experts(x, w, ids, gu, dn), want[0])


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4"])
def test_the_expert_ops_give_the_host_bits_and_count_the_routing(fmt):
    """ops.moe's entries (the torch path on the CPU, the kernels on CUDA) on cached experts."""
    (gu, dn), (cgu, cdn), (x, w, ids), slot = _problem(fmt, "some", seed=4)
    host = {ri: experts(x, w, ids, gu, dn, ri) for ri in (True, False)}
    for ri in (True, False):
        assert torch.equal(experts(x, w, ids, cgu, cdn, ri), host[ri]), ri
    split = lambda t: [t[:3], t[3:]]  # noqa: E731
    chunks = experts_of_chunks(split(x), split(w), split(ids), cgu, cdn)
    want = experts_of_chunks(split(x), split(w), split(ids), gu, dn)
    assert all(torch.equal(a, b) for a, b in zip(chunks, want, strict=True))
    routed = torch.bincount(ids.flatten().cpu(), minlength=E + 1).to(torch.int32)
    assert torch.equal(cgu.counts[0].cpu(), 3 * routed)  # (decode, prefill, the chunks)
    read = lambda t: (torch.bincount(t.flatten().cpu(), minlength=E + 1) > 0).int()  # noqa: E731
    grouped = x.is_cuda  # (the chunks in one grouped call, or one call a chunk)
    chunk_reads = read(ids) if grouped else read(ids[:3]) + read(ids[3:])
    assert torch.equal(cgu.counts[1].cpu(), 2 * read(ids) + chunk_reads)
    _spoil_cached((gu, dn), slot)  # the torch path reads a cached expert from its slot too
    assert torch.equal(experts(x, w, ids, cgu, cdn, True), host[True])
    assert not torch.equal(experts(x, w, ids, gu, dn, True), host[True])


@small
def test_the_shared_expert_never_reads_a_slot():
    gu, dn = _stack("bf16", E, 2 * I, H, seed=4), _stack("bf16", E, H, I, seed=5)
    sgu, sdn = _stack("bf16", 2 * I, H, seed=6), _stack("bf16", H, I, seed=7)
    slot = torch.tensor(SLOTS["all"])
    cgu, cdn = _cached(gu, slot, E), _cached(dn, slot, E)
    cdn = CachedExperts(cdn.host, cdn.cache, cgu.slot, cgu.counts)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, H, generator=g).to(device=DEV, dtype=DTYPE)
    w, ids = route(torch.randn(4, E + 1, generator=g).to(device=DEV, dtype=DTYPE), K_TOP, True, shared=True)
    from nextserve.ops.triton.moe_grouped import grouped_decode_experts

    got = grouped_decode_experts(x, w, ids, cgu, cdn, shared=(sgu, sdn))
    assert torch.equal(got, grouped_decode_experts(x, w, ids, gu, dn, shared=(sgu, sdn)))
    experts(x, w, ids, cgu, cdn, True, (sgu, sdn))  # (the op counts)
    assert int(cgu.counts[0, E]) == 4 and int(cgu.counts[1, E]) == 1  # the shared expert's, counted last


def test_a_cache_must_hold_the_host_form():
    gu = _stack("bf16", E, 2 * I, H, seed=9)
    slot = torch.full((E,), -1, dtype=torch.int32)
    counts = torch.zeros(2, E + 1, dtype=torch.int32)
    q = Fp8Weight(*quantize(torch.randn(E, 2 * I, H)))
    with pytest.raises(ValueError, match="a cache of Fp8Weight"):
        CachedExperts(gu.cpu(), empty_like_slots(q, 2, torch.device("cpu")), slot, counts)
    with pytest.raises(ValueError, match="do not hold"):
        CachedExperts(gu.cpu(), torch.empty(2, I, H), slot, counts)
    with pytest.raises(ValueError, match="slot table"):
        CachedExperts(gu.cpu(), torch.empty(2, 2 * I, H), slot.long(), counts)
    assert expert_bytes(gu) == 2 * I * H * 4
    assert expert_bytes(q) == 2 * I * H + 2 * 2 * 4  # the values and their 2 x 2 block scales
