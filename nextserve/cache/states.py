"""Per-sequence recurrent state in fixed-size slots: GDN conv + recurrent state, PLE n-gram context
and conv history, the indexer's open-block raw keys, and the MTP layer's input of the last committed row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..ops.pinned import upload


def _span(kind_layers: tuple[int, ...], layers: range) -> range:
    """The per-kind indices of the layers of `kind_layers` that lie in `layers` (contiguous)."""
    inside = [k for k, i in enumerate(kind_layers) if i in layers]
    before = sum(1 for i in kind_layers if i < layers.start)
    return range(inside[0], inside[-1] + 1) if inside else range(before, before)


@dataclass(frozen=True)
class KindRange:
    """The per-kind indices (GDN, PLE, attention) whose state one holder keeps: the whole model, or a
    pipeline stage's layer range. Attention index n_qsa is the MTP layer's, kept by the last stage."""

    gdn: range
    ple: range
    attn: range

    @classmethod
    def of(cls, cfg: ModelConfig, layers: range | None = None, with_mtp: bool = True) -> KindRange:
        layers = layers if layers is not None else range(cfg.num_hidden_layers)
        attn = _span(cfg.qsa_layers, layers)
        if with_mtp and layers.stop == cfg.num_hidden_layers:
            attn = range(attn.start, len(cfg.qsa_layers) + 1)
        return cls(_span(cfg.gdn_layers, layers), _span(cfg.ple_layers, layers), attn)


def local(kinds: range, index: int, what: str) -> int:
    """Position of a model-wide kind index in a holder that keeps `kinds`."""
    if index not in kinds:
        raise IndexError(f"{what} index {index} is not held here (this stage holds {kinds})")
    return index - kinds.start


# Which tensors make up one slot; a SequenceImage copies exactly these.
STATE_FIELDS = ("gdn_conv", "gdn_rec", "ple_ctx", "ple_conv", "index_tail", "mtp_hidden")


class StateSlots:
    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        num_attn_layers: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kinds: KindRange | None = None,
        window_steps: int = 0,
    ) -> None:
        """`kinds`: the state this holder keeps (default: every layer's, with `num_attn_layers`
        attention planes). `window_steps`: slots kept per slot for rewinding verify windows (the
        speculative drafts per window: a window of 1 + k rows keeps the state after each of its first k)."""
        if num_slots <= 0:
            raise ValueError("need at least one state slot")
        if kinds is None:
            kinds = KindRange(range(len(cfg.gdn_layers)), range(len(cfg.ple_layers)), range(num_attn_layers))
        elif len(kinds.attn) != num_attn_layers:
            raise ValueError(f"num_attn_layers {num_attn_layers} != the {len(kinds.attn)} of kinds")
        self.cfg, self.num_slots, self.kinds = cfg, num_slots, kinds
        # NOTE: one slot more than the free list holds: the scratch slot of padded decode rows. After it
        # come window_steps keep slots per slot (keep_slot), never allocated.
        self.scratch_slot = num_slots
        self.window_steps = window_steps
        nG, nP, S = len(kinds.gdn), len(kinds.ple), num_slots + 1 + num_slots * window_steps
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
        # NOTE: the target's pre-mixer streams of the last committed row (position length-1): the MTP
        # row at a position runs once the token after it is known (runtime/mtp_runner.py), so an image
        # taken at a chunk end carries what a resumed prompt needs to run it. Kept where the MTP
        # layer's planes are (attention index n_qsa): [1, S, nH], else [0, S, nH].
        n_mtp = int(len(cfg.qsa_layers) in kinds.attn)
        self.mtp_hidden = torch.zeros(n_mtp, S, cfg.hc_hidden, dtype=dtype, **kw)
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def slot_bytes(cfg: ModelConfig, kinds: KindRange, dtype: torch.dtype) -> int:
        """Bytes one slot takes in a holder of `kinds` (KindRange; attention index n_qsa: the MTP layer's
        planes), as __init__ allocates them."""
        elem = torch.empty((), dtype=dtype).element_size()
        nG, nP, n_attn = len(kinds.gdn), len(kinds.ple), len(kinds.attn)
        hist = (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size
        return (
            nG * cfg.gdn_conv_dim * (cfg.linear_conv_kernel_dim - 1) * elem
            + nG * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
            + nP * ((cfg.ngram_size - 1) * 8 + cfg.hc_hidden * hist * elem)
            + n_attn * (cfg.indexer_compress_ratio - 1) * cfg.indexer_head_dim * elem
            + int(len(cfg.qsa_layers) in kinds.attn) * cfg.hc_hidden * elem
        )

    def gdn_planes(self, gdn_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv histories, recurrent states) of every slot for one GDN layer (model-wide index)."""
        i = local(self.kinds.gdn, gdn_index, "GDN")
        return self.gdn_conv[i], self.gdn_rec[i]

    def ple_planes(self, ple_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = local(self.kinds.ple, ple_index, "PLE")
        return self.ple_ctx[i], self.ple_conv[i]

    def tail_plane(self, attn_index: int) -> torch.Tensor:
        return self.index_tail[local(self.kinds.attn, attn_index, "attention")]

    def mtp_hidden_plane(self) -> torch.Tensor:
        """Every slot's MTP input of its last committed row [S, nH] (see the NOTE in __init__)."""
        if self.mtp_hidden.shape[0] == 0:
            raise IndexError("the MTP layer's state is not held here")
        return self.mtp_hidden[0]

    def keep_slot(self, slot: int, step: int) -> int:
        """Where a verify window on `slot` keeps its state after its row `step` (< window_steps)."""
        if not (0 <= slot < self.num_slots and 0 <= step < self.window_steps):
            raise IndexError(f"no keep slot for slot {slot}, step {step} ({self.window_steps} steps)")
        return self.num_slots + 1 + slot * self.window_steps + step

    def rewind(self, kept: list[int], slots: list[int]) -> None:
        """Restore each of `slots` from the keep slot at the same place in `kept`: every state a
        window's step keeps (GDN, PLE, the target's indexer tails), not the MTP layer's (its tail and
        input rows are the drafter's, runtime/mtp_runner.py)."""
        if slots:
            self._copy_target(kept, slots)

    def fork(self, slot: int, shadow: int) -> None:
        """Copy slot's target state (what `rewind` restores) into `shadow`, where a guessed window runs
        (--pipeline-windows). Not `rewind`, which a pipeline's driver mirrors to every stage: each stage
        forks its own planes as it reaches the guessed window (runtime/stage_worker.py)."""
        self._copy_target([slot], [shadow])

    def _copy_target(self, src_slots: list[int], dst_slots: list[int]) -> None:
        dev = self.gdn_rec.device
        src = upload(src_slots, torch.long, dev)
        dst = upload(dst_slots, torch.long, dev)
        n_target = self.index_tail.shape[0] - self.mtp_hidden.shape[0]  # the MTP's tail plane is last
        for field in (self.gdn_conv, self.gdn_rec, self.ple_ctx, self.ple_conv, self.index_tail[:n_target]):
            field.index_copy_(1, dst, field.index_select(1, src))

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot's state (what `copy_out` copies)."""
        return sum(getattr(self, n)[:, 0].numel() * getattr(self, n).element_size() for n in STATE_FIELDS)

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
