"""The Flash-Next decoder, built for a range of layers (a whole model or one pipeline stage)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops.linear import linear
from ..ops.pointwise import rowwise
from ..ops.rope import cos_sin, inv_freq
from .batch import DecodeBatch, ForwardBatch, WindowBatch
from .decoder_layer import DecoderLayer
from .hyper import GatedResidual
from .params import Projection, Weight

# NOTE: rows of the rotary table past max_position_embeddings: a verify window or an MTP draft chain
# reaches up to speculative_tokens + 1 (at most 33) positions past a sequence's last one.
ROTARY_MARGIN = 64


class FlashNext(nn.Module):
    """Layers `layers` of the model; the first stage embeds, the last owns the mixer and lm_head."""

    def __init__(self, cfg: ModelConfig, layers: range | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_range = layers if layers is not None else range(cfg.num_hidden_layers)
        self.is_first = self.layer_range.start == 0
        self.is_last = self.layer_range.stop == cfg.num_hidden_layers
        gdn, qsa, ple = cfg.gdn_layers, cfg.qsa_layers, cfg.ple_layers
        self.embed_tokens = Weight(cfg.vocab_size, cfg.hidden_size) if self.is_first else None
        self.layers = nn.ModuleDict(
            {
                str(i): DecoderLayer(
                    cfg,
                    cfg.layer_types[i],
                    gdn.index(i) if i in gdn else qsa.index(i),
                    ple.index(i) if i in ple else None,
                )
                for i in self.layer_range
            }
        )
        if self.is_last:
            self.hyper_connection_mixer = GatedResidual(cfg, inject=False)
            self.lm_head = Projection(cfg.vocab_size, cfg.hidden_size)
        self.register_buffer("inv_freq", inv_freq(cfg.rotary_dim, cfg.rope_theta), persistent=False)
        self.rotary_table: torch.Tensor | None = None  # [P, 2 * rot] cos | sin of every position (prepare)
        self._superseded_tables: list[torch.Tensor] = []  # kept alive for CUDA graphs (prepare)

    def init_buffers(self, device: torch.device | str) -> None:
        """The rotary frequencies on device (after a meta-device build: model/loader.materialize)."""
        self.inv_freq = inv_freq(self.cfg.rotary_dim, self.cfg.rope_theta).to(device)

    def prepare(self, max_positions: int | None = None) -> None:
        """After loading weights, before serving: stack the projections and, on CUDA, tabulate the rotary
        cos and sin of every position below `max_positions` (the engine's max_context; default the
        model's max_position_embeddings)."""
        self.fuse_projections()
        dev, dtype = self.inv_freq.device, next(self.parameters()).dtype
        rows = self.rotary_rows(max_positions)
        # NOTE: rebuilt when an engine needs more rows than an earlier engine over the same model had
        # (benchmarks reuse one model): a position past the table would be an out-of-bounds gather. The
        # old table stays allocated: the earlier engine's CUDA graphs read it by address.
        if dev.type == "cuda" and (self.rotary_table is None or self.rotary_table.shape[0] < rows):
            # NOTE: a row is cos_sin's result at that position bit for bit: on CUDA cos_sin is elementwise
            # per element (a product, cos, sin, a rounding), whatever the tensor around it. The table only
            # saves launches: a decode step took cos and sin three times (the rope, each QSA block key),
            # about six launches each, where a gather is one. (On the CPU, vectorised cos/sin may round a
            # row by its place in the tensor, so the CPU keeps computing them row by row.)
            positions = torch.arange(rows, device=dev)
            if self.rotary_table is not None:
                self._superseded_tables.append(self.rotary_table)
            self.rotary_table = torch.cat(cos_sin(positions, self.inv_freq, dtype), dim=-1)

    def rotary_rows(self, max_positions: int | None = None) -> int:
        """Rows of the rotary table: every position a sequence of max_positions tokens reaches, and the
        ROTARY_MARGIN a verify window or an MTP draft chain reaches past its last one."""
        return (max_positions or self.cfg.max_position_embeddings) + ROTARY_MARGIN

    def fuse_projections(self) -> None:
        """Stack the projections that read one input (see params.fuse_rows); after loading weights."""
        if getattr(self, "_fused", False):
            return
        for m in self.modules():
            if m is not self and hasattr(m, "fuse"):
                m.fuse()
        self._fused = True

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, row_invariant: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary cos, sin [T, rot] at positions [T]: rows of the table when there is one for them."""
        t = self.rotary_table
        if t is not None and t.dtype == dtype and t.device == positions.device:
            cs = t.index_select(0, positions)
        else:  # cos and sin from one call (joined, then split into views): half the launches
            joined = lambda p: torch.cat(cos_sin(p, self.inv_freq, dtype), dim=-1)  # noqa: E731
            cs = rowwise(joined, positions, row_invariant)
        cos, sin = cs.chunk(2, dim=-1)
        return cos, sin

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, row_invariant: bool = False):
        """(cos, sin) at the rows' positions, and `cos_sin` itself for the QSA block keys."""
        return *self.cos_sin(positions, dtype, row_invariant), self.cos_sin

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> streams [T, nH]: the unscaled embedding copied into every stream."""
        return F.embedding(input_ids, self.embed_tokens.weight).repeat(1, self.cfg.hc_count)

    def forward(self, batch: ForwardBatch, x: torch.Tensor | None = None) -> torch.Tensor:
        """Runs this stage's layers. x [T, nH] comes from the previous stage (None on the first).
        Returns the streams after the last layer of the range, before the mixer [T, nH]."""
        if x is None:
            x = self.embed(batch.input_ids)
        rope = self.rope(batch.positions, x.dtype, batch.row_invariant)
        for layer in self.layers.values():
            x = layer(x, batch, rope)
        return x

    def forward_chunks(self, batches: list[ForwardBatch]) -> list[torch.Tensor]:
        """Prefill chunks of equal length, one a batch (a sequence's chunks in order), on the first stage:
        each one's streams [n, nH] after this stage's layers, bit for bit what `forward` gives it alone.

        # NOTE: layer by layer, every op runs on each chunk's own tensors as it does alone (a sequence's
        # later chunk after its earlier one, reading the state that one left), except the routed experts:
        # one grouped call for all the chunks with one chunk's blocks (ops.moe.experts_of_chunks), so each
        # expert's weights are read once for them all."""
        assert all(not b.row_invariant and len(b.chunks) == 1 for b in batches)
        xs = [self.embed(b.input_ids) for b in batches]
        ropes = [self.rope(b.positions, xs[0].dtype) for b in batches]
        for layer in self.layers.values():
            xs = layer.forward_chunks(xs, batches, ropes)
        return xs

    def decode(self, batch: DecodeBatch, x: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row for B sequences: streams [B, nH] after this stage's last layer."""
        return self.window(WindowBatch.of(batch), x)

    def window(self, batch: WindowBatch, x: torch.Tensor | None = None) -> torch.Tensor:
        """W decode steps of B sequences in one forward (verify windows; W = 1 is a decode step): streams
        [W*B, nH] after this stage's last layer, row j*B + b being what the j-th of W serial decode steps
        gives sequence b, bit for bit.

        # NOTE: no host reads and no value-dependent shapes, so a window can be captured once per
        # (W, B) and replayed as a CUDA graph; every op is row-invariant, so a row's bits do not depend
        # on the rows (or padding rows) beside it (C1)."""
        if x is None:
            x = self.embed(batch.input_ids)
        rope = self.rope(batch.positions, x.dtype, True)
        for layer in self.layers.values():
            x = layer.window(x, batch, rope)
        return x

    def logits(self, streams: torch.Tensor, row_invariant: bool = True) -> torch.Tensor:
        """streams [R, nH] (rows to sample from) -> logits [R, V]. The mixer is the last norm."""
        z, _ = self.hyper_connection_mixer.mix(streams, row_invariant)
        return linear(z, self.lm_head.operand, row_invariant)
