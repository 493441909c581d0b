"""State slots' keep slots (verify windows' rewinds, engine/speculative.py): where they are, and what a
rewind copies back: every target layer's state, never the MTP layer's (the drafter keeps its own)."""

import pytest
import torch

from nextserve.cache.states import STATE_FIELDS, KindRange, StateSlots


def _fill(slots: StateSlots, slot: int, value: float) -> None:
    for name in STATE_FIELDS:
        getattr(slots, name)[:, slot] = value


def test_keep_slots_sit_after_the_scratch_slot(oracle_config) -> None:
    slots = StateSlots(oracle_config, 3, 2, torch.float32, window_steps=4)
    assert slots.scratch_slot == 3 and slots.gdn_rec.shape[1] == 3 + 1 + 3 * 4
    got = {slots.keep_slot(s, j) for s in range(3) for j in range(4)}
    assert got == set(range(4, 16))  # distinct, never a slot the free list hands out, nor the scratch
    for bad in ((3, 0), (0, 4), (-1, 0), (0, -1)):
        with pytest.raises(IndexError):
            slots.keep_slot(*bad)
    with pytest.raises(IndexError):
        StateSlots(oracle_config, 3, 2, torch.float32).keep_slot(0, 0)  # no speculation: no keep slots


def test_rewind_restores_the_target_state_and_leaves_the_mtp_state(oracle_config) -> None:
    n_attn = len(oracle_config.qsa_layers) + 1  # the MTP layer's planes come last
    slots = StateSlots(oracle_config, 2, n_attn, torch.float32, window_steps=2)
    _fill(slots, 0, 1.0)  # the slot, after its window
    _fill(slots, 1, 5.0)  # another sequence: untouched
    kept = slots.keep_slot(0, 1)
    _fill(slots, kept, 7.0)  # what the window's row 1 kept (its MTP planes: never written there)
    slots.rewind([kept], [0])
    for name in ("gdn_conv", "gdn_rec", "ple_ctx", "ple_conv"):
        assert (getattr(slots, name)[:, 0] == 7).all(), name
    assert (slots.index_tail[: n_attn - 1, 0] == 7).all()
    assert (slots.index_tail[n_attn - 1, 0] == 1).all() and (slots.mtp_hidden[:, 0] == 1).all()
    for name in STATE_FIELDS:
        assert (getattr(slots, name)[:, 1] == 5).all(), name
    slots.rewind([], [])  # nothing to rewind: nothing happens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_bytes_counts_what_is_allocated(oracle_config, dtype) -> None:
    """The engine checks GPU memory for its slots with slot_bytes before allocating them."""
    n_attn = len(oracle_config.qsa_layers) + 1
    slots = StateSlots(oracle_config, 3, n_attn, dtype, window_steps=2)
    total = sum(getattr(slots, name).numel() * getattr(slots, name).element_size() for name in STATE_FIELDS)
    assert total == StateSlots.slot_bytes(oracle_config, slots.kinds, dtype) * slots.gdn_rec.shape[1]
    stage = KindRange.of(oracle_config, range(0, 2))  # a first stage: no MTP planes
    part = StateSlots(oracle_config, 3, len(stage.attn), dtype, kinds=stage)
    total = sum(getattr(part, name).numel() * getattr(part, name).element_size() for name in STATE_FIELDS)
    assert total == StateSlots.slot_bytes(oracle_config, stage, dtype) * part.gdn_rec.shape[1]
