"""Load a Flash-Next safetensors checkpoint (one file or sharded with an index) into runtime-named tensors.

Runtime names are transformers' runtime state-dict names with the `model.` / `model.language_model.`
prefix stripped: experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and
`mlp.experts.down_proj` [E, H, I]), each PLE table concatenated from its row shards, PLE index buffers
dropped (the model recomputes them), and the MTP block's single layer named `mtp.layer.` (checkpoint
`mtp.layers.0.`). Every tensor's shape is checked against the config before any data is read.
"""

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
from tqdm import tqdm

from nextserve.config import GDN, ConfigError, ModelConfig
from nextserve.model.ple import table_rows as ple_table_rows

INDEX_FILE = "model.safetensors.index.json"
PROGRESS_MIN_BYTES = 1 << 30  # below ~1 GB a load takes seconds and a bar is noise

_TEXT_PREFIXES = ("model.language_model.", "model.")
_MTP_LAYER_RUNTIME = "mtp.layer."
_MTP_LAYER_CKPT = "mtp.layers.0."
_PLE_TABLE = "ple.ple_embedding.ngram_embedding"
_SHARD_RE = re.compile(r"^(?P<base>.+\.ngram_embedding)\.shard_(?P<idx>\d+)\.weight$")
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2}


Shape = tuple[int, ...]
Index = tuple[int | slice, ...]


# ---- expected runtime shapes -----------------------------------------------------------------------------


def _hc_shapes(cfg: ModelConfig, prefix: str, inject: bool = True) -> dict[str, Shape]:
    n, nh, r = cfg.hc_count, cfg.hc_hidden, cfg.hc_lowrank
    shapes = {
        f"{prefix}hc_norm.weight": (nh,),
        f"{prefix}input_mix_weight_down.weight": (r, nh),
        f"{prefix}input_mix_weight_up.weight": (nh, r),
    }
    if inject:
        shapes[f"{prefix}block_inject_weight.weight"] = (n, nh)
    return shapes


def _moe_shapes(cfg: ModelConfig, prefix: str) -> dict[str, Shape]:
    h, e, i, si = (
        cfg.hidden_size,
        cfg.num_experts,
        cfg.moe_intermediate_size,
        cfg.shared_expert_intermediate_size,
    )
    return {
        f"{prefix}gate.weight": (e, h),
        f"{prefix}experts.gate_up_proj": (e, 2 * i, h),
        f"{prefix}experts.down_proj": (e, h, i),
        f"{prefix}shared_expert.gate_proj.weight": (si, h),
        f"{prefix}shared_expert.up_proj.weight": (si, h),
        f"{prefix}shared_expert.down_proj.weight": (h, si),
        f"{prefix}shared_expert_gate.weight": (1, h),
    }


def _gdn_shapes(cfg: ModelConfig, prefix: str) -> dict[str, Shape]:
    h, conv = cfg.hidden_size, cfg.gdn_conv_dim
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    return {
        f"{prefix}in_proj_qkv.weight": (conv, h),  # flat [q | k | v]
        f"{prefix}in_proj_z.weight": (hv * dv, h),
        f"{prefix}in_proj_b.weight": (hv, h),
        f"{prefix}in_proj_a.weight": (hv, h),
        f"{prefix}conv1d.weight": (conv, 1, cfg.linear_conv_kernel_dim),
        f"{prefix}A_log": (hv,),
        f"{prefix}dt_bias": (hv,),
        f"{prefix}norm.weight": (dv,),
        f"{prefix}out_proj.weight": (h, hv * dv),
    }


def _qsa_shapes(cfg: ModelConfig, prefix: str) -> dict[str, Shape]:
    if cfg.extra.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported (Flash-Next attention has no biases)")
    h, nq, nkv, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ni, di = cfg.indexer_n_heads, cfg.indexer_head_dim
    n_index_kv = int(cfg.extra.get("indexer_kv_heads") or 1)
    return {
        f"{prefix}q_proj.weight": (nq * 2 * dh, h),  # per head [q | gate]
        f"{prefix}k_proj.weight": (nkv * dh, h),
        f"{prefix}v_proj.weight": (nkv * dh, h),
        f"{prefix}o_proj.weight": (h, nq * dh),
        f"{prefix}q_norm.weight": (dh,),
        f"{prefix}k_norm.weight": (dh,),
        f"{prefix}indexer.index_qk_proj.weight": ((ni + n_index_kv) * di, h),  # [q heads | raw key]
        f"{prefix}indexer.q_layernorm.weight": (di,),
        f"{prefix}indexer.k_layernorm.weight": (di,),
    }


def _ple_shapes(cfg: ModelConfig, prefix: str, ple_index: int) -> dict[str, Shape]:
    nh, d = cfg.hc_hidden, cfg.ple_embed_dim
    return {
        f"{prefix}ple_embedding.ngram_embedding.weight": (
            ple_table_rows(cfg, ple_index),
            d // cfg.ple_num_heads,
        ),
        f"{prefix}key_proj.weight": (nh, d),
        f"{prefix}value_proj.weight": (cfg.hidden_size, d),
        f"{prefix}norm_key.weight": (nh,),
        f"{prefix}norm_query.weight": (nh,),
        f"{prefix}norm_conv.weight": (nh,),
        f"{prefix}conv1d.weight": (nh, 1, cfg.ple_conv_kernel_size),
    }


def _layer_shapes(cfg: ModelConfig, i: int) -> dict[str, Shape]:
    p = f"layers.{i}."
    shapes: dict[str, Shape] = {}
    if i in cfg.ple_layers:
        shapes |= _ple_shapes(cfg, f"{p}ple.", cfg.ple_layers.index(i))
    if cfg.layer_types[i] == GDN:
        shapes |= _gdn_shapes(cfg, f"{p}linear_attn.")
    else:
        shapes |= _qsa_shapes(cfg, f"{p}self_attn.")
    shapes |= _moe_shapes(cfg, f"{p}mlp.")
    shapes |= _hc_shapes(cfg, f"{p}attn_hyper_connection.")
    shapes |= _hc_shapes(cfg, f"{p}mlp_hyper_connection.")
    return shapes


def _mtp_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    h, nh = cfg.hidden_size, cfg.hc_hidden
    shapes: dict[str, Shape] = {
        "mtp.fc_embedding.weight": (h, h),
        "mtp.fc_hidden.weight": (h, h),  # shared across streams
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (nh,),  # one joint norm over all n*H features
    }
    shapes |= _hc_shapes(cfg, "mtp.hyper_connection_mixer.", inject=False)
    p = _MTP_LAYER_RUNTIME
    shapes |= _qsa_shapes(cfg, f"{p}self_attn.")
    shapes |= _moe_shapes(cfg, f"{p}mlp.")
    shapes |= _hc_shapes(cfg, f"{p}attn_hyper_connection.")
    shapes |= _hc_shapes(cfg, f"{p}mlp_hyper_connection.")
    return shapes


def expected_shapes(
    cfg: ModelConfig,
    layers: range | None = None,
    with_embed: bool = True,
    with_head: bool = True,
    with_mtp: bool = False,
) -> dict[str, Shape]:
    """Runtime name -> shape of every tensor `load_weights` returns for these arguments, in load order."""
    layers = range(cfg.num_hidden_layers) if layers is None else layers
    bad = [i for i in layers if not 0 <= i < cfg.num_hidden_layers]
    if bad:
        raise ConfigError(f"layer range {layers} is outside the model's {cfg.num_hidden_layers} layers")
    shapes: dict[str, Shape] = {}
    if with_embed:
        shapes["embed_tokens.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for i in layers:
        shapes |= _layer_shapes(cfg, i)
    if with_head:
        shapes |= _hc_shapes(cfg, "hyper_connection_mixer.", inject=False)
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    if with_mtp:
        if cfg.mtp_num_hidden_layers != 1:
            raise ConfigError(f"mtp_num_hidden_layers={cfg.mtp_num_hidden_layers} is not supported (only 1)")
        shapes |= _mtp_shapes(cfg)
    return shapes


# ---- checkpoint files ------------------------------------------------------------------------------------


class _Checkpoint:
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

    def nbytes(self, name: str) -> int:
        sl = self.handle(self.where[name]).get_slice(name)
        return math.prod(sl.get_shape()) * _DTYPE_BYTES.get(sl.get_dtype(), 1)

    def read(self, name: str) -> torch.Tensor:
        return self.handle(self.where[name]).get_tensor(name)


# ---- recipes: which checkpoint tensors fill which part of a runtime tensor -------------------------------


@dataclass(frozen=True)
class _Piece:
    name: str  # checkpoint tensor
    index: Index  # where it goes in the runtime tensor; () is the whole tensor


@dataclass(frozen=True)
class _Recipe:
    shape: Shape
    pieces: tuple[_Piece, ...]


def _ckpt_name(runtime: str, text_prefix: str) -> str:
    if runtime.startswith(_MTP_LAYER_RUNTIME):
        return _MTP_LAYER_CKPT + runtime[len(_MTP_LAYER_RUNTIME) :]
    if runtime.startswith("mtp.") or runtime == "lm_head.weight":
        return runtime
    return text_prefix + runtime


def _missing(ckpt: _Checkpoint, name: str, alt: str = "") -> ConfigError:
    return ConfigError(f"checkpoint {str(ckpt.dir)!r} is missing tensor {name!r}{alt}")


def _expert_recipe(ckpt: _Checkpoint, runtime: str, full: str, shape: Shape, cfg: ModelConfig) -> _Recipe:
    """Fused tensor as is, or stacked from per-expert `experts.{e}.{gate,up,down}_proj.weight`."""
    if full in ckpt.where:
        return _Recipe(shape, (_Piece(full, ()),))
    base = full.rsplit(".", 1)[0]  # ...mlp.experts
    inter = cfg.moe_intermediate_size
    if runtime.endswith("gate_up_proj"):
        parts = [("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))]  # gate rows first
    else:
        parts = [("down_proj", slice(None))]
    first = f"{base}.0.{parts[0][0]}.weight"
    if first not in ckpt.where:
        raise _missing(ckpt, full, f" (or per-expert {first!r})")
    pieces = []
    for e in range(cfg.num_experts):
        for proj, rows in parts:
            name = f"{base}.{e}.{proj}.weight"
            if name not in ckpt.where:
                raise _missing(ckpt, name)
            pieces.append(_Piece(name, (e, rows)))
    return _Recipe(shape, tuple(pieces))


def _ple_recipe(ckpt: _Checkpoint, full: str, shape: Shape, shards: dict[str, list[int]]) -> _Recipe:
    """Whole table as is, or its row shards `ngram_embedding.shard_{i}.weight` concatenated in index order."""
    if full in ckpt.where:
        return _Recipe(shape, (_Piece(full, ()),))
    base = full[: -len(".weight")]
    found = sorted(shards.get(base, []))
    if not found:
        raise _missing(ckpt, f"{base}.shard_0.weight", f" (or {full!r})")
    gap = next((i for i, j in enumerate(found) if i != j), None)
    if gap is not None:
        raise _missing(ckpt, f"{base}.shard_{gap}.weight")
    pieces, row = [], 0
    for i in found:
        name = f"{base}.shard_{i}.weight"
        got = ckpt.shape(name)
        if len(got) != 2 or got[1] != shape[1]:
            raise ConfigError(f"tensor {name!r} has shape {list(got)}, expected [rows, {shape[1]}]")
        pieces.append(_Piece(name, (slice(row, row + got[0]),)))
        row += got[0]
    if row != shape[0]:
        raise ConfigError(f"PLE table {base}.shard_* has {row} rows in all, expected {shape[0]}")
    return _Recipe(shape, tuple(pieces))


def _recipe(
    ckpt: _Checkpoint, runtime: str, shape: Shape, cfg: ModelConfig, prefix: str, shards: dict[str, list[int]]
) -> _Recipe:
    full = _ckpt_name(runtime, prefix)
    if runtime.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return _expert_recipe(ckpt, runtime, full, shape, cfg)
    if runtime.endswith(f"{_PLE_TABLE}.weight"):
        return _ple_recipe(ckpt, full, shape, shards)
    if full not in ckpt.where:
        raise _missing(ckpt, full)
    return _Recipe(shape, (_Piece(full, ()),))


def _check_piece_shapes(ckpt: _Checkpoint, recipe: _Recipe) -> None:
    meta = torch.empty(recipe.shape, device="meta")
    for piece in recipe.pieces:
        want = tuple(meta[piece.index].shape)
        got = ckpt.shape(piece.name)
        if got != want:
            raise ConfigError(f"tensor {piece.name!r} has shape {list(got)}, expected {list(want)}")


def _text_prefix(names: list[str]) -> str:
    # Released checkpoints use the multimodal layout (model.language_model.*), transformers' CausalLM
    # saves model.*; the names tell which, whatever config.json's model_type says.
    return next((p for p in _TEXT_PREFIXES if any(n.startswith(p) for n in names)), "model.")


def _ple_shards(names: list[str]) -> dict[str, list[int]]:
    shards: dict[str, list[int]] = {}
    for name in names:
        m = _SHARD_RE.match(name)
        if m:
            shards.setdefault(m["base"], []).append(int(m["idx"]))
    return shards


def load_weights(
    model_dir: Path,
    cfg: ModelConfig,
    layers: range | None = None,
    with_embed: bool = True,
    with_head: bool = True,
    with_mtp: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Read the tensors one pipeline stage needs, keyed by runtime name, cast to dtype on device.

    `layers` keeps global layer indices in the keys; `with_head` brings the final mixer and lm_head. Raises
    ConfigError naming the problem: missing directory or files, a missing tensor, a wrong shape, or MTP
    asked of a checkpoint without `mtp.*`. Tensors not asked for (vision tower, PLE buffers, hash tables,
    other layers) are never read.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"model directory {str(model_dir)!r} does not exist")
    shapes = expected_shapes(cfg, layers, with_embed, with_head, with_mtp)
    with ExitStack() as stack:
        ckpt = _Checkpoint(model_dir, stack)
        names = list(ckpt.where)
        if with_mtp and not any(n.startswith("mtp.") for n in names):
            raise ConfigError(
                f"checkpoint has no MTP weights (mtp.*) in {str(model_dir)!r}; run without MTP speculation"
            )
        prefix, shards = _text_prefix(names), _ple_shards(names)
        recipes = {rt: _recipe(ckpt, rt, shape, cfg, prefix, shards) for rt, shape in shapes.items()}
        for recipe in recipes.values():
            _check_piece_shapes(ckpt, recipe)
        total = sum(ckpt.nbytes(p.name) for r in recipes.values() for p in r.pieces)
        with tqdm(
            total=total, unit="B", unit_scale=True, desc="loading weights", disable=total < PROGRESS_MIN_BYTES
        ) as bar:
            return {rt: _assemble(ckpt, r, dtype, device, bar) for rt, r in recipes.items()}


def _assemble(
    ckpt: _Checkpoint, recipe: _Recipe, dtype: torch.dtype, device: torch.device | str, bar: tqdm
) -> torch.Tensor:
    if len(recipe.pieces) == 1 and recipe.pieces[0].index == ():
        src = ckpt.read(recipe.pieces[0].name)
        bar.update(src.numel() * src.element_size())
        return src.to(device=device, dtype=dtype)
    # Copy each piece into its slot so a fused expert tensor never exists twice (pieces + stacked copy).
    out = torch.empty(recipe.shape, dtype=dtype, device=device)
    for piece in recipe.pieces:
        src = ckpt.read(piece.name)
        out[piece.index].copy_(src)
        bar.update(src.numel() * src.element_size())
    return out
