"""What the pipeline's driver does to its own cache planes outside a forward, recorded so that every
other stage repeats it on its planes (runtime/pipeline.py)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..cache.host_store import HostImage
from ..cache.kv_pool import KVPool
from ..cache.prefix import PrefixCache
from ..cache.sequence import SequenceImage
from ..cache.states import StateSlots


class _StateCopy(dict):
    """A copy of a slot's state (a prefix image's `state`) with the key the stages file theirs under."""

    key: int


class StageMirror:
    """Records what the driver does to its own planes outside a forward, which every other stage repeats
    on its planes before the next step's batches: page copies (copy-on-write), verify windows' rewinds
    from keep slots (`rewind`), prefix images' slot states, taken (`save`), restored (`load`) and dropped
    once the driver's copy is gone (`drop`), and with a host image store (`mirror_host`) images moved to
    host memory (`spill`), brought back into fresh pages (`unspill`) and dropped there (`host_drop`)."""

    def __init__(self, pool: KVPool, slots: StateSlots) -> None:
        self.ops: list[tuple] = []
        self._keys = 0
        copy_page, copy_out, copy_in, rewind = pool.copy_page, slots.copy_out, slots.copy_in, slots.rewind

        def mirrored_copy_page(src: int, dst: int) -> None:
            copy_page(src, dst)
            self.ops.append(("copy_page", src, dst))

        def mirrored_copy_out(slot: int) -> _StateCopy:
            state = self._keyed(copy_out(slot))
            self.ops.append(("save", state.key, slot))
            return state

        def mirrored_copy_in(slot: int, tensors: dict[str, torch.Tensor]) -> None:
            if not isinstance(tensors, _StateCopy):
                raise RuntimeError("a state slot restored from a copy the pipeline stages do not hold")
            copy_in(slot, tensors)
            self.ops.append(("load", tensors.key, slot))

        def mirrored_rewind(kept: list[int], slot_ids: list[int]) -> None:
            rewind(kept, slot_ids)
            if slot_ids:
                self.ops.append(("rewind", list(kept), list(slot_ids)))

        pool.copy_page, slots.copy_out, slots.copy_in, slots.rewind = (
            mirrored_copy_page,
            mirrored_copy_out,
            mirrored_copy_in,
            mirrored_rewind,
        )

    def mirror_host(self, prefix: PrefixCache | Any) -> None:
        """Record the moves of the prefix cache (to and from its host image store) or of the preempted
        sequences (engine/preemption.Swapper): whatever holds `spill` and `unspill`."""
        spill, unspill = prefix.spill, prefix.unspill

        def mirrored_spill(pool: KVPool, image: SequenceImage) -> HostImage:
            key, pages = self._key_of(image.state), list(image.pages)
            host = spill(pool, image)
            host.mirror_id = self._new_key()  # type: ignore[attr-defined]
            self.ops.append(("spill", key, host.mirror_id, pages))  # before its pages can be reused
            weakref.finalize(host, self._host_drop, host.mirror_id)
            return host

        def mirrored_unspill(pool: KVPool, host: HostImage, device: torch.device) -> SequenceImage | None:
            image = unspill(pool, host, device)
            if image is None:
                return None
            state = self._keyed(image.state)
            self.ops.append(("unspill", host.mirror_id, image.pages, state.key))  # type: ignore[attr-defined]
            return SequenceImage(image.length, state, image.pages)

        prefix.spill, prefix.unspill = mirrored_spill, mirrored_unspill

    def _new_key(self) -> int:
        self._keys += 1
        return self._keys - 1

    def _keyed(self, tensors: dict[str, torch.Tensor]) -> _StateCopy:
        """A slot-state copy under a new key, whose drop is recorded once the driver lets it go."""
        state = _StateCopy(tensors)
        state.key = self._new_key()
        weakref.finalize(state, self._drop, state.key)  # not self.ops.append: `take` swaps the list
        return state

    @staticmethod
    def _key_of(state: dict) -> int:
        if not isinstance(state, _StateCopy):
            raise RuntimeError("an image whose slot state the pipeline stages do not hold")
        return state.key

    def _drop(self, key: int) -> None:
        self.ops.append(("drop", key))

    def _host_drop(self, host_id: int) -> None:
        self.ops.append(("host_drop", host_id))

    def take(self) -> list[tuple]:
        ops, self.ops = self.ops, []
        return ops
