"""The device expert cache of host-held routed experts (runtime/expert_cache.py): with any cache size the
engine gives the tokens and logprobs of all experts on the device (C1), greedy and seeded, batched and
speculating; the policy's fills, evictions, admission and accounting; its flag's bad values.

# NOTE: on the CPU backend the host is the device: `--experts host --expert-cache-gib N` runs the cache (its
# slot tables, counts, fills and the ops reading slots) over experts that stay where they are."""

from __future__ import annotations

import pytest
import torch
from spec_cases import same, serial_reference
from torch import nn

from nextserve import LLM, SamplingParams
from nextserve.cli import build_parser, engine_config_from_args
from nextserve.config import ConfigError
from nextserve.engine.memory_plan import MemoryPlan
from nextserve.engine_config import DEFAULT_MODEL, EngineConfig
from nextserve.model.params import operand_of
from nextserve.ops.cached_experts import CachedExperts
from nextserve.runtime.expert_cache import FILLS_PER_READ, ExpertCache

FLAGS = dict(device="cpu", dtype="float32", prefill_chunk=32, page_size=16, kv_capacity=4096)
SLOT_GIB = 8 * 3 * 256 * 128 * 4 / 2**30  # one float32 expert (gate|up and down) in each of 8 layers
PARAMS = [
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=16, temperature=0.9, top_k=20, seed=5, ignore_eos=True, logprobs=1),
]


@pytest.fixture(scope="module")
def serial():
    return serial_reference(FLAGS, PARAMS)[1:]


@pytest.mark.parametrize(
    "flags",
    [
        dict(expert_cache_gib=SLOT_GIB * 1.01),  # one expert a layer
        dict(expert_cache_gib=SLOT_GIB * 3.5, max_concurrency=3),
        dict(
            expert_cache_gib=SLOT_GIB * 2.5, max_concurrency=3, speculative_method="mtp", speculative_tokens=3
        ),
        dict(
            expert_cache_gib=SLOT_GIB * 8, max_concurrency=3, speculative_method="ngram", speculative_tokens=3
        ),
        dict(expert_cache_gib=SLOT_GIB * 1.01, max_concurrency=3, pipeline_stages=2, stage_layers="3,5"),
    ],
    ids=["one slot", "batched", "mtp", "ngram, every expert", "two stages"],
)
def test_any_cache_gives_the_tokens_of_device_experts(serial, flags, one_torch_thread) -> None:
    prompts, want = serial
    llm = LLM(DEFAULT_MODEL, experts="host", **(FLAGS | flags))
    cache = llm.engine.expert_cache  # (with stages: stage 0's, in the driver; each stage has its own)
    layers = 3 if "stage_layers" in flags else 8  # the MoE layers it covers
    assert cache is not None and cache.slots == min(8, int(flags["expert_cache_gib"] / SLOT_GIB * 8 / layers))
    cache.read_every = 1  # (a read every step, so that these short runs fill slots and hit them)
    assert isinstance(llm.engine.model.layers["0"].mlp.experts.gate_up, CachedExperts)
    for i, p in enumerate(PARAMS):
        same(want[i], llm.generate(prompts, p))
    s = llm.stats()
    assert s["expert_cache_fills"] >= cache.slots and s["expert_cache_hits"] > 0, s
    assert s["expert_cache_slots"] == layers * cache.slots
    for ly in cache.layers:  # the slot table names exactly the experts the slots hold
        for e, c in enumerate(ly.gate_up.slot.tolist()):
            assert (c >= 0) == (e in ly.held) and (c < 0 or ly.held[c] == e)
            if c >= 0:
                assert torch.equal(ly.gate_up.cache[c], ly.gate_up.host[e])
                assert torch.equal(ly.down.cache[c], ly.down.host[e])
    if "pipeline_stages" not in flags:
        assert f"expert cache: {cache.slots} experts x 8 layers" in llm.engine.plan.table()
    llm.close()


class _Owner(nn.Module):
    """An MoE layer's expert stacks (E experts of 4 x 2 and 2 x 2)."""

    def __init__(self, E: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 4, 2), requires_grad=False)
        self.down_proj = nn.Parameter(torch.randn(E, 2, 2), requires_grad=False)

    gate_up = property(lambda self: operand_of(self, "gate_up_proj"))
    down = property(lambda self: operand_of(self, "down_proj"))


def _route(cache: ExpertCache, layer: int, *experts: int) -> None:
    """One call routing one row to each of `experts` in `layer`."""
    cache.layers[layer].gate_up.count(torch.tensor([list(experts)]))


def _slot_of(cache: ExpertCache, layer: int) -> dict[int, int]:
    return {e: c for e, c in enumerate(cache.layers[layer].gate_up.slot.tolist()) if c >= 0}


def test_the_policy_caches_what_the_routing_uses_most() -> None:
    model = nn.ModuleList([_Owner(16), _Owner(16)])
    cache = ExpertCache(model, 2, torch.device("cpu"), read_every=1)
    assert isinstance(model[0].gate_up, CachedExperts) and cache.nbytes == 2 * 2 * (8 + 4) * 4
    for _ in range(3):
        _route(cache, 0, 3, 5)
        _route(cache, 0, 3)
        cache.step()
    assert _slot_of(cache, 0) == {3: 0, 5: 1} and _slot_of(cache, 1) == {}  # (layer 1 saw nothing)
    assert cache.fills == 2
    # a window is accounted at the step after it: the first ran before any fill (3 misses), the second
    # with both experts cached (3 hits)
    assert (cache.hits, cache.misses) == (3, 3)
    _route(cache, 0, 3, 5)
    cache.step()
    assert (cache.hits, cache.misses) == (6, 3)
    # admission: a one-off expert beside the usual traffic does not evict the hot ones
    _route(cache, 0, 3, 5)
    _route(cache, 0, 9)
    cache.step()
    _route(cache, 0, 3, 5)
    cache.step()
    assert _slot_of(cache, 0) == {3: 0, 5: 1} and cache.fills == 2
    # a new hot expert evicts the colder of the two, in place
    for _ in range(6):
        _route(cache, 0, 9, 9, 9)
        _route(cache, 0, 3)
        cache.step()
    assert _slot_of(cache, 0) == {3: 0, 9: 1} and cache.fills == 3
    ly = cache.layers[0]
    assert torch.equal(ly.gate_up.cache[1], ly.gate_up.host[9]) and torch.equal(
        ly.down.cache[1], ly.down.host[9]
    )
    cache.reset()
    assert cache.stats()["expert_cache_hits"] == 0 and int(cache.counts.sum()) == 0


def test_fills_a_read_are_bounded() -> None:
    cache = ExpertCache(nn.ModuleList([_Owner(16)]), 16, torch.device("cpu"), read_every=1)
    _route(cache, 0, *range(16))
    cache.step()  # (a window's routing is read at the step after it)
    assert len(_slot_of(cache, 0)) == 0
    cache.step()
    assert len(_slot_of(cache, 0)) == FILLS_PER_READ
    cache.step()
    assert len(_slot_of(cache, 0)) == 2 * FILLS_PER_READ


def test_bytes_over_the_link_count_misses_by_call_and_fills() -> None:
    cache = ExpertCache(nn.ModuleList([_Owner(4)]), 1, torch.device("cpu"), read_every=1)
    one = (8 + 4) * 4
    _route(cache, 0, 1, 1, 2)  # one call: experts 1 and 2 read once each
    cache.step()
    cache.step()
    assert cache.link_bytes == 2 * one + one  # two reads, then the fill of expert 1
    assert (cache.hits, cache.misses) == (0, 3)


@pytest.mark.parametrize("bad", [-1, -0.5, True, "big", float("inf"), 2e6])
def test_expert_cache_gib_values(bad) -> None:
    with pytest.raises(ConfigError, match="expert_cache_gib must be"):
        EngineConfig(experts="host", expert_cache_gib=bad)


def test_expert_cache_gib_needs_host_experts_and_room_for_one_expert() -> None:
    with pytest.raises(ConfigError, match="needs experts host or auto"):
        EngineConfig(expert_cache_gib=1)
    EngineConfig(expert_cache_gib=0)  # (none: fine anywhere)
    with pytest.raises(ConfigError, match="holds no expert: one expert in each of the 8 MoE layers"):
        LLM(DEFAULT_MODEL, experts="host", expert_cache_gib=SLOT_GIB / 2, **FLAGS)
    assert LLM(DEFAULT_MODEL, experts="host", **FLAGS).engine.expert_cache is None  # auto: none on the CPU


def test_the_flag_parses_numbers_and_auto() -> None:
    for given, want in (("0.5", 0.5), ("2", 2.0), ("auto", "auto")):
        args = build_parser().parse_args(["serve", "--experts", "host", "--expert-cache-gib", given])
        assert engine_config_from_args(args).expert_cache_gib == want
    plan = MemoryPlan(torch.device("cpu"), expert_cache=(3, 48, 2**30))
    assert "expert cache: 3 experts x 48 layers = 1.00 GiB" in plan.table()


def test_a_cache_keeps_the_shared_expert_riding_the_routed_kernels() -> None:
    """A layer whose shared expert has the routed experts' width runs it as one more routed expert in
    decode (SparseMoe._decode); with a cache it still does (the same launches as without, so the same bits
    on a GPU), and its output is the uncached one's."""
    import dataclasses

    from nextserve.bench.model import bench_config
    from nextserve.model.moe import SparseMoe

    cfg, _ = bench_config("tiny")
    cfg = dataclasses.replace(cfg, shared_expert_intermediate_size=cfg.moe_intermediate_size)
    torch.manual_seed(0)
    moe = SparseMoe(cfg)
    for p in moe.parameters():
        p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    moe.fuse()
    u = torch.randn(3, cfg.hidden_size)
    assert moe._decode_weights() is not None
    want = moe(u, True)
    ExpertCache(nn.ModuleList([moe]), 2, torch.device("cpu"))
    assert isinstance(moe.experts.gate_up, CachedExperts) and moe._decode_weights() is not None
    assert torch.equal(moe(u, True), want)


def test_the_routing_is_read_every_few_steps() -> None:
    """The policy runs once in `read_every` steps; the routing of the steps between adds up."""
    cache = ExpertCache(nn.ModuleList([_Owner(4)]), 1, torch.device("cpu"), read_every=3)
    for _ in range(3):
        _route(cache, 0, 2)
        cache.step()  # the third reads (a snapshot of three calls' routing)
    assert cache.hits + cache.misses == 0 and _slot_of(cache, 0) == {}
    for _ in range(3):
        cache.step()
    assert (cache.hits, cache.misses) == (0, 3) and _slot_of(cache, 0) == {2: 0}


def test_settle_accounts_every_pair_routed_so_far_and_changes_no_slot() -> None:
    """settle(): the pairs of a snapshot in flight and those counted since are both accounted, the counts
    start again from zero, the slot tables stay; what the bench's windows rely on to count their own steps."""
    cache = ExpertCache(nn.ModuleList([_Owner(16)]), 2, torch.device("cpu"), read_every=1)
    _route(cache, 0, 3, 5)
    cache.step()  # (fills 3 and 5; their snapshot was accounted, a new one is taken)
    _route(cache, 0, 3, 9)
    cache.step()  # a snapshot of (3, 9) in flight, not yet accounted
    _route(cache, 0, 3, 5, 7)
    before, slots = cache.stats(), _slot_of(cache, 0)
    assert slots and cache.taking
    cache.settle()
    after = cache.stats()
    got = {k: after[k] - before[k] for k in ("expert_cache_hits", "expert_cache_misses")}
    assert sum(got.values()) == 5 and int(cache.counts.sum()) == 0, got
    assert _slot_of(cache, 0) == slots and cache.taking is False
    cache.settle()  # nothing routed since: nothing to account
    assert cache.stats() == after
