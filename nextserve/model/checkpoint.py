"""Where a checkpoint's values are: its safetensors files (one, or sharded with an index, each opened at
most once) and, for each runtime tensor, the checkpoint tensors that fill it (`Recipe`): itself, per-expert
tensors stacked into the fused experts, or the PLE table's row shards. Shapes are checked before any data
is read. model/loader.py reads the recipes."""

from __future__ import annotations

import json
import math
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from nextserve.config import ConfigError, ModelConfig
from nextserve.model.shapes import MTP_LAYER_RUNTIME, Shape

INDEX_FILE = "model.safetensors.index.json"

TEXT_PREFIXES = ("model.language_model.", "model.")
_MTP_LAYER_CKPT = "mtp.layers.0."
_PLE_TABLE = "ple.ple_embedding.ngram_embedding"
_FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_SHARD_RE = re.compile(r"^(?P<base>.+\.ngram_embedding)\.shard_(?P<idx>\d+)\.weight$")
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2}
_DTYPE_BYTES |= {"F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}

Index = tuple[int | slice, ...]


class Checkpoint:
    """Tensor name -> file map of a checkpoint; opens each file at most once, on first use."""

    def __init__(self, model_dir: Path, stack: ExitStack) -> None:
        self.dir = model_dir
        self._stack = stack
        self._handles: dict[Path, Any] = {}
        self.where = self._index_via_json() if (model_dir / INDEX_FILE).is_file() else self._index_via_files()

    def _index_via_json(self) -> dict[str, Path]:
        path = self.dir / INDEX_FILE
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"{path} is not a safetensors index (needs a 'weight_map' object): {exc}"
            ) from exc
        files = {name: self.dir / fname for name, fname in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise ConfigError(f"{path} names {f.name!r}, which is missing from {str(self.dir)!r}")
        return files

    def _index_via_files(self) -> dict[str, Path]:
        paths = sorted(self.dir.glob("*.safetensors"))
        if not paths:
            raise ConfigError(f"no *.safetensors files in {str(self.dir)!r}")
        # Without an index every file may hold anything, so all get opened now and their handles kept.
        return {name: p for p in paths for name in self.handle(p).keys()}

    def handle(self, path: Path) -> Any:
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(
                safe_open(str(path), framework="pt", device="cpu")
            )
        return self._handles[path]

    def shape(self, name: str) -> Shape:
        return tuple(self.handle(self.where[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype name (F8_E4M3, BF16, F32, ...)."""
        return self.handle(self.where[name]).get_slice(name).get_dtype()

    def nbytes(self, name: str) -> int:
        sl = self.handle(self.where[name]).get_slice(name)
        return math.prod(sl.get_shape()) * _DTYPE_BYTES.get(sl.get_dtype(), 1)

    def read(self, name: str) -> torch.Tensor:
        return self.handle(self.where[name]).get_tensor(name)


# ---- recipes: which checkpoint tensors fill which part of a runtime tensor -------------------------------


@dataclass(frozen=True)
class Piece:
    name: str  # checkpoint tensor
    index: Index  # where it goes in the runtime tensor; () is the whole tensor


@dataclass(frozen=True)
class Recipe:
    shape: Shape
    pieces: tuple[Piece, ...]


def _ckpt_name(runtime: str, text_prefix: str) -> str:
    if runtime.startswith(MTP_LAYER_RUNTIME):
        return _MTP_LAYER_CKPT + runtime[len(MTP_LAYER_RUNTIME) :]
    if runtime.startswith("mtp.") or runtime == "lm_head.weight":
        return runtime
    return text_prefix + runtime


def _missing(ckpt: Checkpoint, name: str, alt: str = "") -> ConfigError:
    return ConfigError(f"checkpoint {str(ckpt.dir)!r} is missing tensor {name!r}{alt}")


def _expert_pieces(runtime: str, full: str, cfg: ModelConfig) -> list[Piece]:
    """The per-expert tensors `experts.{e}.{gate,up,down}_proj.weight` a fused expert tensor stacks."""
    base = full.rsplit(".", 1)[0]  # ...mlp.experts
    inter = cfg.moe_intermediate_size
    if runtime.endswith("gate_up_proj"):
        parts = [("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))]  # gate rows first
    else:
        parts = [("down_proj", slice(None))]
    return [
        Piece(f"{base}.{e}.{proj}.weight", (e, rows)) for e in range(cfg.num_experts) for proj, rows in parts
    ]


def _shard_name(base: str, i: int) -> str:
    return f"{base}.shard_{i}.weight"


def _expert_recipe(ckpt: Checkpoint, runtime: str, full: str, shape: Shape, cfg: ModelConfig) -> Recipe:
    """Fused tensor as is, or stacked from per-expert tensors (`_expert_pieces`)."""
    if full in ckpt.where:
        return Recipe(shape, (Piece(full, ()),))
    pieces = _expert_pieces(runtime, full, cfg)
    if pieces[0].name not in ckpt.where:
        raise _missing(ckpt, full, f" (or per-expert {pieces[0].name!r})")
    for piece in pieces:
        if piece.name not in ckpt.where:
            raise _missing(ckpt, piece.name)
    return Recipe(shape, tuple(pieces))


def _ple_recipe(ckpt: Checkpoint, full: str, shape: Shape, shards: dict[str, list[int]]) -> Recipe:
    """Whole table as is, or its row shards `ngram_embedding.shard_{i}.weight` concatenated in index order."""
    if full in ckpt.where:
        return Recipe(shape, (Piece(full, ()),))
    base = full[: -len(".weight")]
    found = sorted(shards.get(base, []))
    if not found:
        raise _missing(ckpt, _shard_name(base, 0), f" (or {full!r})")
    gap = next((i for i, j in enumerate(found) if i != j), None)
    if gap is not None:
        raise _missing(ckpt, _shard_name(base, gap))
    pieces, row = [], 0
    for i in found:
        name = _shard_name(base, i)
        got = ckpt.shape(name)
        if len(got) != 2 or got[1] != shape[1]:
            raise ConfigError(f"tensor {name!r} has shape {list(got)}, expected [rows, {shape[1]}]")
        pieces.append(Piece(name, (slice(row, row + got[0]),)))
        row += got[0]
    if row != shape[0]:
        raise ConfigError(f"PLE table {base}.shard_* has {row} rows in all, expected {shape[0]}")
    return Recipe(shape, tuple(pieces))


def recipe(
    ckpt: Checkpoint, runtime: str, shape: Shape, cfg: ModelConfig, prefix: str, shards: dict[str, list[int]]
) -> Recipe:
    full = _ckpt_name(runtime, prefix)
    if runtime.endswith(_FUSED_EXPERTS):
        return _expert_recipe(ckpt, runtime, full, shape, cfg)
    if runtime.endswith(f"{_PLE_TABLE}.weight"):
        return _ple_recipe(ckpt, full, shape, shards)
    if full not in ckpt.where:
        raise _missing(ckpt, full)
    return Recipe(shape, (Piece(full, ()),))


def recipe_names(ckpt: Checkpoint, runtime: str, cfg: ModelConfig, prefix: str, shards) -> list[str]:
    """The checkpoint tensors a runtime tensor's recipe reads, from the names alone (no file is opened):
    what the unread-tensor check counts as known."""
    full = _ckpt_name(runtime, prefix)
    if full in ckpt.where:
        return [full]
    if runtime.endswith(_FUSED_EXPERTS):
        return [p.name for p in _expert_pieces(runtime, full, cfg)]
    if runtime.endswith(f"{_PLE_TABLE}.weight"):
        base = full[: -len(".weight")]
        return [_shard_name(base, i) for i in shards.get(base, [])]
    return []


def check_piece_shapes(ckpt: Checkpoint, recipe: Recipe) -> None:
    meta = torch.empty(recipe.shape, device="meta")
    for piece in recipe.pieces:
        want = tuple(meta[piece.index].shape)
        got = ckpt.shape(piece.name)
        if got != want:
            raise ConfigError(f"tensor {piece.name!r} has shape {list(got)}, expected {list(want)}")


def text_prefix(names: list[str]) -> str:
    # Released checkpoints use the multimodal layout (model.language_model.*), transformers' CausalLM
    # saves model.*; the names tell which, whatever config.json's model_type says.
    return next((p for p in TEXT_PREFIXES if any(n.startswith(p) for n in names)), "model.")


def ple_shards(names: list[str]) -> dict[str, list[int]]:
    shards: dict[str, list[int]] = {}
    for name in names:
        m = _SHARD_RE.match(name)
        if m:
            shards.setdefault(m["base"], []).append(int(m["idx"]))
    return shards
