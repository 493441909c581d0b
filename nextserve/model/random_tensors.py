"""The tensors of a random checkpoint, in file order and named as transformers saves them, each drawn on
demand from its own generator seeded by (seed, tensor name): values do not depend on layout, sharding,
expert fusion or MTP, and a huge table never has to exist in memory at once."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from nextserve.config import ModelConfig
from nextserve.model.ple import head_vocab_sizes, multipliers
from nextserve.model.presets import VISION_CONFIG
from nextserve.model.shapes import expected_shapes

Shape = tuple[int, ...]


@dataclass(frozen=True)
class PlannedTensor:
    """A checkpoint tensor to write: its name, shape and dtype, and how to draw its values."""

    name: str  # checkpoint name
    shape: Shape
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def seed_for(seed: int, key: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def initial_values(key: str, shape: Shape, gen: torch.Generator) -> torch.Tensor:
    """Random fp32 values with scales that keep a forward pass tame and every code path live.

    Projections get std 1/sqrt(fan_in), so each block maps O(1) inputs to O(1) outputs at any width.
    Embeddings are O(1) too: the hyper-connections normalise each stream anyway, and unit scale keeps the
    token signal comparable to the block outputs added to the residual.
    """

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    module = key.rsplit(".", 2)[-2] if key.endswith(".weight") else ""
    if key.startswith("model.visual."):
        return normal(0.02)
    if key.endswith("linear_attn.norm.weight"):
        return normal(0.1, mean=1.0)  # plain-weight gated norm: w, not 1+w
    if key.endswith("A_log"):
        return torch.rand(shape, generator=gen).mul(16 - 0.01).add(0.01).log()  # log U(0.01, 16)
    if key.endswith("dt_bias"):
        return normal(0.1, mean=1.0)
    if "norm" in module:
        return normal(0.1)  # (1+w) norms: non-zero so the weight path is exercised
    if key.endswith("ple.conv1d.weight"):
        return normal(0.2)  # transformers zero-inits it, which would hide the PLE conv entirely
    if key.endswith("linear_attn.conv1d.weight"):
        return normal(1 / math.sqrt(shape[-1]))
    if key.endswith("embed_tokens.weight") or ".ngram_embedding." in key:
        return normal(1.0)
    if key == "lm_head.weight":
        # Logits std ~1.5 as in a trained model, so greedy argmax rarely sits on a near-tie.
        return normal(3 / math.sqrt(shape[-1]))
    return normal(1 / math.sqrt(shape[-1]))


def _random(seed: int, key: str, shape: Shape, dtype: torch.dtype) -> PlannedTensor:
    def make() -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed_for(seed, key))
        return initial_values(key, shape, gen).to(dtype)

    return PlannedTensor(key, shape, dtype, make)


def _const(name: str, value: torch.Tensor) -> PlannedTensor:
    return PlannedTensor(name, tuple(value.shape), value.dtype, lambda: value)


def _chunk_rows(rows: int, parts: int) -> list[int]:
    # torch.chunk's split, which transformers' save uses: ceil-sized chunks, possibly fewer than `parts`.
    size = math.ceil(rows / parts)
    return [min(size, rows - start) for start in range(0, rows, size)]


def _ple_tensors(
    cfg: ModelConfig, seed: int, key: str, shape: Shape, dtype: torch.dtype
) -> Iterator[PlannedTensor]:
    layer = int(key.split(".")[1])
    ple_index = cfg.ple_layers.index(layer)
    base = key[: -len(".weight")]
    for i, rows in enumerate(_chunk_rows(shape[0], cfg.split_ngram_parts)):
        # Each row shard has its own generator so a huge table never needs to exist in memory at once.
        yield _random(seed, f"{base}.shard_{i}.weight", (rows, shape[1]), dtype)
    sizes = head_vocab_sizes(cfg.ngram_vocab_size_base, ple_index, cfg.ple_num_heads)
    offsets = [sum(sizes[:h]) for h in range(len(sizes))]
    emb = key[: -len(".ngram_embedding.weight")]
    yield _const(
        f"{emb}.layer_multipliers",
        torch.tensor(multipliers(cfg.vocab_size, cfg.ngram_size, ple_index, cfg.seed)),
    )
    yield _const(f"{emb}.ngram_heads_vocab_sizes", torch.tensor(sizes, dtype=torch.long))
    yield _const(f"{emb}.ngram_heads_offsets", torch.tensor(offsets, dtype=torch.long))


def _expert_tensors(
    cfg: ModelConfig, seed: int, key: str, shape: Shape, dtype: torch.dtype, fused: bool
) -> Iterator[PlannedTensor]:
    base = key.rsplit(".", 1)[0]  # ...mlp.experts
    projs = ("gate_proj", "up_proj") if key.endswith("gate_up_proj") else ("down_proj",)
    per_expert = [
        _random(
            seed,
            f"{base}.{e}.{proj}.weight",
            shape[1:] if proj == "down_proj" else (shape[1] // 2, shape[2]),
            dtype,
        )
        for e in range(cfg.num_experts)
        for proj in projs
    ]
    if not fused:
        yield from per_expert
        return

    def make() -> torch.Tensor:
        # Built from the per-expert draws, so fused and per-expert checkpoints hold the same values.
        rows = [t.make() for t in per_expert]  # gate_e, up_e, gate_e+1, ... -> [E, 2I, H] gate rows first
        return torch.stack([torch.cat(rows[e : e + len(projs)]) for e in range(0, len(rows), len(projs))])

    yield PlannedTensor(key, shape, dtype, make)


def _checkpoint_name(key: str, layout: str) -> str:
    if key.startswith(("mtp.", "lm_head.")):
        return key
    return ("model.language_model." if layout == "multimodal" else "model.") + key


def _vision_tensors(seed: int, hidden: int, dtype: torch.dtype) -> Iterator[PlannedTensor]:
    vc = VISION_CONFIG
    d, ff, merged = (
        vc["hidden_size"],
        vc["intermediate_size"],
        vc["hidden_size"] * vc["spatial_merge_size"] ** 2,
    )
    patch = (d, vc["in_channels"], vc["temporal_patch_size"], vc["patch_size"], vc["patch_size"])
    shapes: dict[str, Shape] = {
        "patch_embed.proj.weight": patch,
        "patch_embed.proj.bias": (d,),
        "pos_embed.weight": (vc["num_position_embeddings"], d),
        "merger.norm.weight": (d,),
        "merger.norm.bias": (d,),
        "merger.linear_fc1.weight": (merged, merged),
        "merger.linear_fc1.bias": (merged,),
        "merger.linear_fc2.weight": (hidden, merged),
        "merger.linear_fc2.bias": (hidden,),
    }
    for b in range(vc["depth"]):
        p = f"blocks.{b}."
        shapes |= {
            f"{p}norm1.weight": (d,),
            f"{p}norm1.bias": (d,),
            f"{p}norm2.weight": (d,),
            f"{p}norm2.bias": (d,),
            f"{p}attn.qkv.weight": (3 * d, d),
            f"{p}attn.qkv.bias": (3 * d,),
            f"{p}attn.proj.weight": (d, d),
            f"{p}attn.proj.bias": (d,),
            f"{p}mlp.linear_fc1.weight": (ff, d),
            f"{p}mlp.linear_fc1.bias": (ff,),
            f"{p}mlp.linear_fc2.weight": (d, ff),
            f"{p}mlp.linear_fc2.bias": (d,),
        }
    for name, shape in shapes.items():
        yield _random(seed, f"model.visual.{name}", shape, dtype)


def checkpoint_tensors(
    cfg: ModelConfig, seed: int, layout: str, fused_experts: bool, with_mtp: bool, dtype: torch.dtype
) -> list[PlannedTensor]:
    """Every tensor of the checkpoint, in file order, named as transformers saves them."""
    out: list[PlannedTensor] = []
    for key, shape in expected_shapes(cfg, with_mtp=with_mtp).items():
        if key.startswith("mtp.layer."):
            key = "mtp.layers.0." + key[len("mtp.layer.") :]
        if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            out += _expert_tensors(cfg, seed, key, shape, dtype, fused_experts)
        elif key.endswith("ple.ple_embedding.ngram_embedding.weight"):
            out += _ple_tensors(cfg, seed, key, shape, dtype)
        else:
            out.append(_random(seed, key, shape, dtype))
        if key == "mtp.hyper_connection_mixer.input_mix_weight_up.weight":
            # Shipped MTP mixers carry an inject weight that no loader uses; keep it so loaders must skip it.
            n, nh = cfg.hc_count, cfg.hc_hidden
            out.append(_random(seed, "mtp.hyper_connection_mixer.block_inject_weight.weight", (n, nh), dtype))
    out = [replace(t, name=_checkpoint_name(t.name, layout)) for t in out]
    if layout == "multimodal":
        out += _vision_tensors(seed, cfg.hidden_size, dtype)
    return out
