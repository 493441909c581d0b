"""Per-sequence recurrent state in fixed-size slots: GDN conv + recurrent state, PLE n-gram context
and conv history, and the indexer's open-block raw keys."""

from __future__ import annotations

import torch

from ..config import ModelConfig

# Which tensors make up one slot; a SequenceImage copies exactly these.
STATE_FIELDS = ("gdn_conv", "gdn_rec", "ple_ctx", "ple_conv", "index_tail")


class StateSlots:
    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        num_attn_layers: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_slots <= 0:
            raise ValueError("need at least one state slot")
        self.cfg, self.num_slots = cfg, num_slots
        # NOTE: one slot more than the free list holds: the scratch slot of padded decode rows.
        self.scratch_slot = num_slots
        nG, nP, S = len(cfg.gdn_layers), len(cfg.ple_layers), num_slots + 1
        kw = {"device": device}
        self.gdn_conv = torch.zeros(
            nG, S, cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=dtype, **kw
        )
        # NOTE: the recurrent state stays float32 in every model dtype, as the reference keeps it.
        self.gdn_rec = torch.zeros(
            nG, S, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
            dtype=torch.float32, **kw,
        )  # fmt: skip
        self.ple_ctx = torch.zeros(nP, S, cfg.ngram_size - 1, dtype=torch.long, **kw)
        hist = (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size
        self.ple_conv = torch.zeros(nP, S, cfg.hc_hidden, hist, dtype=dtype, **kw)
        c = cfg.indexer_compress_ratio
        self.index_tail = torch.zeros(num_attn_layers, S, c - 1, cfg.indexer_head_dim, dtype=dtype, **kw)
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot")
        slot = self._free.pop()
        self.reset(slot)
        return slot

    def release(self, slot: int) -> None:
        assert slot not in self._free, f"double free of state slot {slot}"
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        """The state before position 0: zeros, and an n-gram context of eos."""
        for name in STATE_FIELDS:
            getattr(self, name)[:, slot].zero_()
        self.ple_ctx[:, slot].fill_(self.cfg.eos_token_id)

    def copy_out(self, slot: int) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name)[:, slot].clone() for name in STATE_FIELDS}

    def copy_in(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        for name in STATE_FIELDS:
            getattr(self, name)[:, slot].copy_(tensors[name])
