"""What the pipeline's driver does to its own cache planes outside a forward, recorded so that every
other stage repeats it on its planes (runtime/pipeline.py)."""

from __future__ import annotations

import weakref

import torch

from ..cache.kv_pool import KVPool
from ..cache.states import StateSlots


class _StateCopy(dict):
    """A copy of a slot's state (a prefix image's `state`) with the key the stages file theirs under."""

    key: int


class StageMirror:
    """Records what the driver does to its own planes outside a forward, which every other stage repeats
    on its planes before the next step's batches: page copies (copy-on-write) and prefix images' slot
    states, taken (`save`), restored (`load`) and dropped once the driver's copy is gone (`drop`)."""

    def __init__(self, pool: KVPool, slots: StateSlots) -> None:
        self.ops: list[tuple] = []
        self._keys = 0
        copy_page, copy_out, copy_in = pool.copy_page, slots.copy_out, slots.copy_in

        def mirrored_copy_page(src: int, dst: int) -> None:
            copy_page(src, dst)
            self.ops.append(("copy_page", src, dst))

        def mirrored_copy_out(slot: int) -> _StateCopy:
            state = _StateCopy(copy_out(slot))
            state.key, self._keys = self._keys, self._keys + 1
            self.ops.append(("save", state.key, slot))
            weakref.finalize(state, self._drop, state.key)  # not self.ops.append: `take` swaps the list
            return state

        def mirrored_copy_in(slot: int, tensors: dict[str, torch.Tensor]) -> None:
            if not isinstance(tensors, _StateCopy):
                raise RuntimeError("a state slot restored from a copy the pipeline stages do not hold")
            copy_in(slot, tensors)
            self.ops.append(("load", tensors.key, slot))

        pool.copy_page, slots.copy_out, slots.copy_in = (
            mirrored_copy_page,
            mirrored_copy_out,
            mirrored_copy_in,
        )

    def _drop(self, key: int) -> None:
        self.ops.append(("drop", key))

    def take(self) -> list[tuple]:
        ops, self.ops = self.ops, []
        return ops
