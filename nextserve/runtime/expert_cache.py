"""The device expert cache of routed experts held in host memory (--experts host, --expert-cache-gib): per MoE
layer a cache of `slots` experts (ops/cached_experts.py's form, which the expert ops read), filled by use
between engine steps.

Policy: frequency with decay and admission. Each layer keeps a score per expert, halved at every read of the
routing counts and then raised by the pairs routed to the expert since the last read; the cache holds the
highest scores. An uncached expert is admitted only when its score beats the lowest-scored cached one (which
it evicts), at most `fills_per_read` experts a layer a read. Chosen over plain LRU because a decode step's
ten experts a layer change every token: recency alone would refill a slot per miss and stream as many bytes
as no cache at all, while trained routers send most pairs to a minority of experts, which scores keep; on
uniform routing admission keeps the cache from churning.

# NOTE: how a fill never changes a result or races a step (C1): the kernels read an expert from its slot
# only while slot[e] names it. A fill of slot c, evicting expert a for expert b, runs in three ordered
# parts: slot[a] = -1 on the compute stream (later kernels read a from host memory); the copy of b into
# slot c on a side stream that first waits for the compute stream (so every kernel that could still read a
# from slot c has finished); slot[b] = c on the compute stream, at a later read, once the copy's event has
# completed. Until then b is read from host memory. Slots change only at reads, so the routing counts of a
# window between two reads are counted against the one slot map that window ran with.
# NOTE: the counts come to the host by a non-blocking copy into pinned memory with an event; a read that
# finds the previous copy unfinished changes nothing and lets the counts run on, so no step waits for the
# cache. CUDA-graph decode steps count their padding rows' routing too (the policy's input only).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import ConfigError
from ..engine_config import EngineConfig
from ..model.params import set_operand
from ..ops.cached_experts import CachedExperts, empty_like_slots, expert_bytes, parts
from ..runtime.device_memory import free_bytes

log = logging.getLogger("nextserve.expert_cache")

DECAY = 0.5  # a score's weight after each read
FILLS_PER_READ = 4  # experts a layer may fill at one read (bounds the bytes a read puts on the link)
# engine steps between reads of the routing: the policy's host work (an argsort and a few passes over the
# experts, a layer at a time) is paid once in that many steps, not in every step of a decode
READ_EVERY = 8


GiB = 2**30


def moe_owners(model: nn.Module) -> list[nn.Module]:
    """The modules holding routed expert stacks (`gate_up_proj`, `down_proj`), in layer order."""
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]


def cache_slots(config: EngineConfig, model: nn.Module, device: torch.device, reserve: int) -> int:
    """Experts a layer's cache holds: --expert-cache-gib over one expert in every MoE layer, at most all of
    them. auto: the device's free memory (under --gpu-memory-gib) less `reserve` bytes (the headroom and
    one sequence of KV: the pool is sized after the cache), none on the CPU. A given size too small for one
    expert a layer is a ConfigError naming the least that works."""
    gib = config.expert_cache_gib
    if gib != "auto":
        return slots_for_gib(model, gib)
    owners = moe_owners(model)
    if not owners or device.type != "cuda":
        return 0
    E, per_slot = owners[0].gate_up.shape[0], _slot_bytes(owners)
    return max(0, min(E, (free_bytes(device, config.gpu_memory_gib) - reserve) // per_slot))


def slots_for_gib(model: nn.Module, gib: float) -> int:
    """Experts a layer's cache of `gib` GiB over all of `model`'s MoE layers holds (at most all of them); a
    size of no expert (but not 0) is a ConfigError naming the least that works."""
    owners = moe_owners(model)
    if not owners or gib == 0:
        return 0
    per_slot = _slot_bytes(owners)
    slots = int(gib * GiB // per_slot)
    if slots < 1:
        raise ConfigError(
            f"expert_cache_gib {gib} holds no expert: one expert in each of the {len(owners)} MoE layers "
            f"takes {per_slot / GiB:.3f} GiB"
        )
    return min(owners[0].gate_up.shape[0], slots)


def _slot_bytes(owners: list[nn.Module]) -> int:
    """Bytes of one more expert in every MoE layer."""
    return (expert_bytes(owners[0].gate_up) + expert_bytes(owners[0].down)) * len(owners)


@dataclass
class _Layer:
    gate_up: CachedExperts
    down: CachedExperts
    held: list[int]  # the expert in each slot, -1 for none
    scores: torch.Tensor  # [E] float64, on the host
    pending: list[tuple[int, int]] = field(default_factory=list)  # (slot, expert) copies in flight


class ExpertCache:
    """Caches of `slots` experts in each of `model`'s MoE layers (modules with `gate_up_proj` and
    `down_proj` stacks of E experts), installed as those modules' operands; `step()` after each engine
    step."""

    def __init__(
        self, model: nn.Module, slots: int, device: torch.device, read_every: int = READ_EVERY
    ) -> None:
        assert slots >= 1 and read_every >= 1, (slots, read_every)
        self.slots, self.device, self.read_every, self.since_read = slots, device, read_every, 0
        owners = moe_owners(model)
        E = owners[0].gate_up.shape[0]
        assert slots <= E, (slots, E)
        # [L, 2, E + 1]: per layer the (row, expert) pairs and the calls that read each expert
        self.counts = torch.zeros(len(owners), 2, E + 1, dtype=torch.int32, device=device)
        self.layers: list[_Layer] = []
        for i, m in enumerate(owners):
            slot = torch.full((E,), -1, dtype=torch.int32, device=device)
            gu, dn = (
                CachedExperts(w, empty_like_slots(w, slots, device), slot, self.counts[i])
                for w in (m.gate_up, m.down)
            )
            set_operand(m, "gate_up_proj", gu)
            set_operand(m, "down_proj", dn)
            self.layers.append(_Layer(gu, dn, [-1] * slots, torch.zeros(E, dtype=torch.float64)))
        self.expert_bytes = expert_bytes(self.layers[0].gate_up.host) + expert_bytes(self.layers[0].down.host)
        cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if cuda else None
        self.snapshot = torch.empty(self.counts.shape, dtype=torch.int32, pin_memory=cuda)
        self.snapshot_done: torch.cuda.Event | None = None
        self.fills_done: torch.cuda.Event | None = None
        self.hits = self.misses = self.fills = self.link_bytes = 0
        self.taking = False  # a snapshot is in flight
        self.reset()

    @property
    def nbytes(self) -> int:
        """Device bytes of all the caches."""
        return sum(t.numel() * t.element_size() for ly in self.layers for w in (ly.gate_up, ly.down)
                   for t in parts(w.cache))  # fmt: skip

    def reset(self) -> None:
        """Forget the routing seen so far (after warm-up, whose random prompts are no use to the policy)."""
        self._wait()
        self.counts.zero_()
        for ly in self.layers:
            ly.scores.zero_()
        self.hits = self.misses = self.fills = self.link_bytes = 0

    def stats(self) -> dict[str, int]:
        return {
            "expert_cache_hits": self.hits,
            "expert_cache_misses": self.misses,
            "expert_cache_fills": self.fills,
            "expert_cache_link_bytes": self.link_bytes,
            "expert_cache_slots": self.slots * len(self.layers),
        }

    def settle(self) -> None:
        """Account every pair routed so far (a snapshot in flight, then the counts since), waiting for the
        device; no slot changes. A measurement that settles at both ends of a window counts exactly the
        window's steps (a read inside it would otherwise reach back to routing before it, such as prompts
        prefilled earlier)."""
        if self.taking:
            self._account(self._arrived())
        self._snapshot()
        self._account(self._arrived())
        self.taking = False

    def step(self) -> None:
        """After an engine step: when the last routing snapshot has arrived, account it, move the finished
        fills into the slot tables, start evictions and fills, and take the next snapshot (the module
        NOTE); once every `read_every` steps."""
        self.since_read += 1
        if self.since_read < self.read_every or (self.taking and not _done(self.snapshot_done)):
            return  # NOTE: the counts run on into the next window; nothing changes meanwhile
        self.since_read = 0
        if self.taking:
            self._account(self.snapshot)
        fills_ready = _done(self.fills_done)
        new = []
        for ly in self.layers:
            if fills_ready:
                self._publish(ly)
            new.append(self._plan(ly) if not ly.pending else [])
        if any(new):
            self._copy(new)
        self._snapshot()

    def _account(self, snap: torch.Tensor) -> None:
        """Hits, misses and link bytes of the window `snap` covers, then the scores."""
        for ly, (pairs, calls) in zip(self.layers, snap.double(), strict=True):
            cached = torch.zeros(pairs.shape[0] - 1, dtype=torch.bool)
            in_flight = {e for _, e in ly.pending}  # (copies not yet named in the slot table)
            cached[[e for e in ly.held if e >= 0 and e not in in_flight]] = True
            routed = pairs[:-1]  # (the shared expert is on the device and never cached)
            self.hits += int(routed[cached].sum())
            self.misses += int(routed[~cached].sum())
            self.link_bytes += int(calls[:-1][~cached].sum()) * self.expert_bytes
            ly.scores.mul_(DECAY).add_(routed)

    def _publish(self, ly: _Layer) -> None:
        """Name the experts of finished copies in the slot table (compute stream)."""
        for c, e in ly.pending:
            ly.gate_up.slot[e] = c
        ly.pending.clear()

    def _plan(self, ly: _Layer) -> list[tuple[int, int]]:
        """Evict and queue fills: the best-scored uncached experts that beat the worst cached ones; returns
        the (slot, expert) copies to start."""
        held = {e for e in ly.held if e >= 0}
        order = torch.argsort(ly.scores, descending=True, stable=True).tolist()
        want = [e for e in order if e not in held and ly.scores[e] > 0][:FILLS_PER_READ]
        for e in want:
            free = [c for c, h in enumerate(ly.held) if h < 0]
            if free:
                c = free[0]
            else:
                c = min(range(self.slots), key=lambda s: (ly.scores[ly.held[s]], ly.held[s]))
                victim = ly.held[c]
                if ly.scores[victim] >= ly.scores[e]:
                    break  # admission: the newcomer must beat the slot's expert
                ly.gate_up.slot[victim] = -1  # NOTE: before the copy, on the compute stream
            ly.held[c] = e
            ly.pending.append((c, e))
        return list(ly.pending)

    def _copy(self, new: list[list[tuple[int, int]]]) -> None:
        """Copy each layer's `new` (slot, expert) pairs, on the side stream after the compute stream's
        work."""
        stream = self.side
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            for ly, copies in zip(self.layers, new, strict=True):
                for c, e in copies:
                    for w in (ly.gate_up, ly.down):
                        for src, dst in zip(parts(w.host), parts(w.cache), strict=True):
                            dst[c].copy_(src[e], non_blocking=True)
                    self.fills += 1
                    self.link_bytes += self.expert_bytes
        if stream is None:
            self.fills_done = None
            for ly in self.layers:  # (on the CPU the copies are done: publish at once)
                self._publish(ly)
        else:
            self.fills_done = torch.cuda.Event()
            self.fills_done.record(stream)

    def _snapshot(self) -> None:
        self.snapshot.copy_(self.counts, non_blocking=self.snapshot.is_pinned())
        self.counts.zero_()
        self.taking = True
        if self.device.type == "cuda":
            self.snapshot_done = torch.cuda.Event()
            self.snapshot_done.record()
        else:
            self.snapshot_done = None

    def _arrived(self) -> torch.Tensor:
        if self.snapshot_done is not None:
            self.snapshot_done.synchronize()
        return self.snapshot

    def _wait(self) -> None:
        for ev in (self.snapshot_done, self.fills_done):
            if ev is not None:
                ev.synchronize()
        self.taking = False


def _done(event: torch.cuda.Event | None) -> bool:
    return event is None or event.query()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None
