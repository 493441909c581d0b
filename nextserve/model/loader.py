"""Load a Flash-Next safetensors checkpoint into runtime-named tensors (model/shapes.py names them), plain or
block-wise FP8 (model/quant.py), for a whole model, one pipeline stage, or the MTP block.

- Every checkpoint tensor is accounted for: read, or skipped by a rule below (`SKIPPED`); any other is a
  ConfigError, as is a float8 tensor without its scales (or scales of the wrong shape), FP8 values in a
  module the config says is not converted, or FP8 tensors without a quantization_config.
- A runtime tensor whose checkpoint values are FP8 stays FP8 in memory (values plus `<name>_scale_inv`,
  float32) when the model reads it through an FP8 kernel (`fp8_capable`: projections and experts) and the
  device has FP8 support; otherwise it is dequantized as it is read (ops/fp8.py), exactly. With
  `quantization="fp8"` plain projections are quantized as they are read (the modules model/quant.py's
  DEFAULT_NOT_CONVERTED leaves out stay plain); with "none" every FP8 tensor is dequantized.
- `load_module` fills a module built on the meta device, allocating each parameter once, in its final
  dtype, on its device: a 118 GB model never exists twice.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from nextserve.config import ConfigError, ModelConfig
from nextserve.model.checkpoint import (
    Checkpoint,
    Recipe,
    check_piece_shapes,
    ple_shards,
    recipe,
    recipe_names,
    text_prefix,
)
from nextserve.model.packed import UnpackedInt4
from nextserve.model.params import (
    INT4_SCALE,
    INT4_ZERO,
    SCALE,
    Projection,
    empty_storage,
    fp8_parameters,
    int4_parameters,
)
from nextserve.model.quant import Fp8Checkpoint, Int4Checkpoint, default_fp8, read_quantization
from nextserve.model.shapes import expected_shapes
from nextserve.ops.fp8 import BLOCK, FP8, dequantize, quantize, scale_shape
from nextserve.ops.int4 import quantize_int4

log = logging.getLogger("nextserve.loader")
_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
PROGRESS_MIN_BYTES = 1 << 30  # below ~1 GB a load takes seconds and a bar is noise
QUANTIZATION_MODES = ("auto", "fp8", "int4", "none")
INT4_GROUP = 128  # --quantization int4: input columns a scale covers (round-to-nearest, symmetric)

# Checkpoint tensors no runtime tensor reads, by rule (anything else unread is an error).
SKIPPED = (
    re.compile(r"^(model\.)?visual\."),  # the vision tower (nextserve serves text)
    re.compile(r"(^|\.)hyper_connection_mixer\.block_inject_weight\.weight$"),  # mixers' unused inject
    re.compile(r"\.ple_embedding\.(layer_multipliers|ngram_heads_vocab_sizes|ngram_heads_offsets)$"),
    re.compile(r"\.(hashstats_[^.]*|token_lookup)$"),  # PLE tables vLLM ignores too
    re.compile(r"^mtp\.shared_head\.head\.weight$"),  # the MTP head: the target's lm_head serves
    re.compile(r"\.rotary_emb\.inv_freq$"),
)


def _module_of(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _scale_index(index: tuple) -> tuple:
    """Where a piece's scales go in the runtime scales: its row slice in whole blocks."""
    out = []
    for i, part in enumerate(index):
        if isinstance(part, slice) and i == len(index) - 1:
            assert (part.start or 0) % BLOCK == 0, part
            stop = None if part.stop is None else -(-part.stop // BLOCK)
            out.append(slice((part.start or 0) // BLOCK, stop))
        else:
            out.append(part)
    return tuple(out)


class CheckpointReader:
    """One load: the recipes of the runtime tensors asked for, their FP8 status, and the reads."""

    def __init__(
        self, model_dir: Path, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], stack: ExitStack
    ) -> None:
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise ConfigError(f"model directory {str(self.dir)!r} does not exist")
        self.cfg = cfg
        self.scheme = read_quantization(cfg.quantization_config)
        self.ckpt = Checkpoint(self.dir, stack)
        if isinstance(self.scheme, Int4Checkpoint):  # W4A16: read as the weights it stands for
            self.ckpt = UnpackedInt4(self.ckpt, self.scheme)
        names = list(self.ckpt.where)
        if any(n.startswith("mtp.") for n in shapes) and not any(n.startswith("mtp.") for n in names):
            raise ConfigError(
                f"checkpoint has no MTP weights (mtp.*) in {str(self.dir)!r}; run without MTP speculation"
            )
        self.fp8_scheme = self.scheme if isinstance(self.scheme, Fp8Checkpoint) else None
        self.prefix, self.shards = text_prefix(names), ple_shards(names)
        self.recipes = {rt: self._recipe(rt, shape) for rt, shape in shapes.items()}
        self.fp8_pieces = {rt: self._fp8(rt, r) for rt, r in self.recipes.items()}
        self._check_unread(names)

    def _recipe(self, runtime: str, shape) -> Recipe:
        r = recipe(self.ckpt, runtime, shape, self.cfg, self.prefix, self.shards)
        check_piece_shapes(self.ckpt, r)
        return r

    def _fp8(self, runtime: str, r: Recipe) -> bool:
        """Whether the recipe's pieces are FP8 (all of them; a mix is an error), their scales checked."""
        kinds = {self.ckpt.dtype(p.name) for p in r.pieces}
        fp8 = {k for k in kinds if k.startswith("F8")}
        if not fp8:
            stray = (
                [self.fp8_scheme.scale_name(p.name) for p in r.pieces] if self.fp8_scheme is not None else []
            )
            if any(name in self.ckpt.where for name in stray):
                raise ConfigError(f"tensor {r.pieces[0].name!r} is not FP8 but has scales beside it")
            return False
        first = r.pieces[0].name
        if fp8 != {"F8_E4M3"}:
            raise ConfigError(f"tensor {first!r} is {sorted(fp8)}: only float8_e4m3fn (F8_E4M3) is read")
        if kinds != fp8:
            raise ConfigError(f"{runtime} mixes FP8 and {sorted(kinds - fp8)} checkpoint tensors ({first!r})")
        if self.fp8_scheme is None:
            raise ConfigError(
                f"tensor {first!r} is float8_e4m3fn but config.json has no quantization_config of FP8: its "
                "scales cannot be read right"
            )
        for p in r.pieces:
            module = _module_of(p.name)
            if not self.fp8_scheme.converted(module):
                raise ConfigError(
                    f"tensor {p.name!r} is FP8 but quantization_config says {module} is not converted"
                )
            scale = self.fp8_scheme.scale_name(p.name)
            if scale not in self.ckpt.where:
                raise ConfigError(f"FP8 tensor {p.name!r} has no scales ({scale!r})")
            want = scale_shape(self.ckpt.shape(p.name))
            if self.ckpt.shape(scale) != want:
                got = list(self.ckpt.shape(scale))
                raise ConfigError(f"tensor {scale!r} has shape {got}, expected {list(want)}")
            if self.ckpt.dtype(scale) not in ("F32", "BF16", "F16"):
                got = self.ckpt.dtype(scale)
                raise ConfigError(f"tensor {scale!r} is {got}: scales are float32 (or 16-bit)")
        return True

    def _check_unread(self, names: list[str]) -> None:
        """Every checkpoint tensor is one the whole model reads (any stage, the MTP block, FP8 scales) or
        one a rule skips."""
        full = expected_shapes(self.cfg, with_mtp=any(n.startswith("mtp.") for n in names))
        known: set[str] = set()
        for rt in full:
            known.update(recipe_names(self.ckpt, rt, self.cfg, self.prefix, self.shards))
        if self.fp8_scheme is not None:
            known |= {self.fp8_scheme.scale_name(n) for n in list(known)}
        unread = [n for n in names if n not in known and not any(rule.search(n) for rule in SKIPPED)]
        if unread:
            shown = ", ".join(repr(n) for n in unread[:5])
            raise ConfigError(
                f"checkpoint {str(self.dir)!r} has {len(unread)} tensor(s) nextserve does not read: {shown}"
                f"{' ...' if len(unread) > 5 else ''} (a different model, or a format this version cannot "
                "read right)"
            )

    # ---- which runtime tensors are FP8 in memory -------------------------------------------------------
    def fp8_names(self, capable: Callable[[str], bool], mode: str, device: torch.device) -> set[str]:
        """Runtime tensors held in FP8: FP8 in the checkpoint (or quantized, mode "fp8"), read by an FP8
        kernel (`capable`), and laid out whole 128-row blocks to a piece."""
        if mode not in QUANTIZATION_MODES:
            raise ConfigError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
        if mode == "none":
            return set()
        if mode == "fp8" and isinstance(self.scheme, Int4Checkpoint):
            raise ConfigError(
                "--quantization fp8 of a W4A16 (int4) checkpoint would quantize quantized weights again: "
                "serve it with --quantization auto (or none), or quantize its unquantized release"
            )
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            if any(self.fp8_pieces.values()) or mode == "fp8":
                log.warning(
                    "%s has no FP8 support (below sm_89): FP8 weights are dequantized on load", device
                )
            return set()
        quantizing = default_fp8() if mode == "fp8" else None
        out = set()
        for rt, r in self.recipes.items():
            if not capable(rt) or not self._aligned(r):
                continue
            if self.fp8_pieces[rt]:
                out.add(rt)
            elif quantizing is not None and all(quantizing.converted(_module_of(p.name)) for p in r.pieces):
                out.add(rt)
        return out

    def int4_names(
        self, capable: Callable[[str], bool], mode: str
    ) -> dict[str, tuple[int, torch.dtype, bool]]:
        """Runtime tensors held in int4, each with (group, scale dtype, symmetric): a W4A16 checkpoint's
        packed weights (mode auto or int4), or with mode "int4" a plain checkpoint's projections and experts
        that `default_fp8`'s lists convert and whose input dimension the group divides (quantized as read);
        only tensors an int4-capable op reads (`capable`), of pieces that keep whole rows."""
        if mode not in QUANTIZATION_MODES:
            raise ConfigError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
        if mode in ("none", "fp8") or self.fp8_scheme is not None:
            if mode == "int4" and self.fp8_scheme is not None:
                raise ConfigError(
                    "--quantization int4 of an FP8 checkpoint would quantize quantized weights again: serve "
                    "it with --quantization auto, or quantize its unquantized release"
                )
            return {}
        out = {}
        packed = self.ckpt.packed if isinstance(self.ckpt, UnpackedInt4) else {}
        for rt, r in self.recipes.items():
            if not capable(rt) or not self._whole_rows(r):
                continue
            if packed and all(p.name in packed for p in r.pieces):
                first = packed[r.pieces[0].name]
                group = self.scheme.group or first.k
                scale = self.ckpt.dtype(r.pieces[0].name)  # (a packed weight's dtype is its scales')
                out[rt] = (group, _TORCH_DTYPES[scale], self.scheme.symmetric)
            elif mode == "int4" and not packed and r.shape[-1] % INT4_GROUP == 0:
                if all(default_fp8().converted(_module_of(p.name)) for p in r.pieces):
                    dtype = _TORCH_DTYPES.get(self.ckpt.dtype(r.pieces[0].name), torch.bfloat16)
                    out[rt] = (INT4_GROUP, dtype if dtype.itemsize == 2 else torch.bfloat16, True)
        return out

    @staticmethod
    def _whole_rows(r: Recipe) -> bool:
        """Whether no piece slices the runtime tensor's last (input) dimension."""
        return all(len(p.index) < len(r.shape) for p in r.pieces)

    @staticmethod
    def _aligned(r: Recipe) -> bool:
        """Whether every piece starts on a 128-row block of the runtime tensor (its scales then stack)."""
        for p in r.pieces:
            rows = p.index[-1] if p.index else None
            if isinstance(rows, slice) and (rows.start or 0) % BLOCK:
                return False
        return True

    # ---- reading ----------------------------------------------------------------------------------------
    def read_into(self, dest: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Fill dest (runtime name -> allocated tensor, FP8 ones with their `SCALE` tensors) from the
        recipes; the names must be exactly the recipes' (and the FP8 ones' scales)."""
        fp8 = {name for name, t in dest.items() if t.dtype == FP8}
        int4 = {name for name, t in dest.items() if t.dtype == torch.int32 and name in self.recipes}
        want = set(self.recipes) | {n + SCALE for n in fp8} | {n + INT4_SCALE for n in int4}
        want |= {n + INT4_ZERO for n in int4 if n + INT4_ZERO in dest}
        if set(dest) != want:
            raise ConfigError(
                f"the model's tensors and the checkpoint's differ: only in the model "
                f"{sorted(set(dest) - want)[:5]}, only in the checkpoint {sorted(want - set(dest))[:5]}"
            )
        total = sum(self.ckpt.nbytes(p.name) for r in self.recipes.values() for p in r.pieces)
        with tqdm(
            total=total, unit="B", unit_scale=True, desc="loading weights", disable=total < PROGRESS_MIN_BYTES
        ) as bar:
            for rt, r in self.recipes.items():
                scales = dest.get(rt + SCALE)
                for piece in r.pieces:
                    if rt in int4:
                        self._read_int4(piece, dest[rt], dest[rt + INT4_SCALE], dest.get(rt + INT4_ZERO))
                    else:
                        self._read_piece(piece, dest[rt], scales, dtype)
                    bar.update(self.ckpt.nbytes(piece.name))

    def _read_int4(self, piece, out: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> None:
        """A piece of an int4 runtime tensor: the checkpoint's packed words, scales and zero points as they
        are, or (--quantization int4) a plain piece quantized as read."""
        if isinstance(self.ckpt, UnpackedInt4) and piece.name in self.ckpt.packed:
            words, s, z = self.ckpt.raw(piece.name)
        else:
            src = self.ckpt.read(piece.name).to(out.device)
            w = quantize_int4(src, src.shape[-1] // scale.shape[-1], scale.dtype)
            words, s, z = w.packed, w.scale, w.zero
        out[piece.index].copy_(words)
        scale[piece.index].copy_(s)
        if zero is not None:
            zero[piece.index].copy_(z)

    def _read_piece(self, piece, out: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> None:
        src = self.ckpt.read(piece.name)
        target = out[piece.index]
        if src.dtype == FP8:
            s = self.ckpt.read(self.fp8_scheme.scale_name(piece.name)).float()
            if scales is not None:  # FP8 in memory too: values and scales as they are
                target.copy_(src)
                scales[_scale_index(piece.index)].copy_(s)
            else:  # exact: values times scales in float32 (float64), rounded once to dtype
                target.copy_(dequantize(src.to(out.device), s.to(out.device), out.dtype))
        elif scales is not None:  # --quantization fp8: quantized as read
            q, s = quantize(src.to(out.device))
            target.copy_(q)
            scales[_scale_index(piece.index)].copy_(s)
        else:
            target.copy_(src)


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
    """The tensors one pipeline stage needs, keyed by runtime name, in dtype on device (FP8 checkpoint
    values dequantized). `layers` keeps global layer indices in the keys; `with_head` brings the final
    mixer and lm_head. Raises ConfigError naming the problem: missing directory or files, a missing or
    unexpected tensor, a wrong shape, or MTP asked of a checkpoint without `mtp.*`."""
    shapes = expected_shapes(cfg, layers, with_embed, with_head, with_mtp)
    with ExitStack() as stack:
        reader = CheckpointReader(Path(model_dir), cfg, shapes, stack)
        dest = {rt: torch.empty(r.shape, dtype=dtype, device=device) for rt, r in reader.recipes.items()}
        reader.read_into(dest, dtype)
        return dest


def check_readable(
    model_dir: str | Path, cfg: ModelConfig, layers: range, with_embed: bool, with_head: bool, with_mtp: bool
) -> None:
    """The ConfigError `load_weights` of these arguments would raise (missing or unexpected tensors, wrong
    shapes, no MTP block), from the files' headers alone: no tensor is read."""
    with ExitStack() as stack:
        shapes = expected_shapes(cfg, layers, with_embed, with_head, with_mtp)
        CheckpointReader(Path(model_dir), cfg, shapes, stack)


def fp8_capable(module: nn.Module, prefix: str = "") -> set[str]:
    """Runtime names of the module's tensors an FP8 kernel reads: projections and experts (params.py)."""
    from .moe import Experts

    names = set()
    for name, m in module.named_modules():
        full = f"{prefix}{name}." if name else prefix
        if isinstance(m, Projection):
            names.add(full + "weight")
        elif isinstance(m, Experts):
            names |= {full + "gate_up_proj", full + "down_proj"}
    return names


def model_fp8_capable(cfg: ModelConfig, with_mtp: bool = True) -> set[str]:
    """`fp8_capable` of a whole model (and its MTP block), from the config alone (built on meta)."""
    from .flash_next import FlashNext
    from .mtp import MTP

    with meta_device():
        names = fp8_capable(FlashNext(cfg))
        if with_mtp:
            names |= fp8_capable(MTP(cfg), "mtp.")
    return names


def load_module(
    module: nn.Module,
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    layers: range | None = None,
    with_embed: bool = True,
    with_head: bool = True,
    with_mtp: bool = False,
    prefix: str = "",
    quantization: str = "auto",
    host: frozenset[str] = frozenset(),
) -> set[str]:
    """Fill `module` (built under `meta_device()`; its parameters named as the runtime names after
    `prefix`) from the checkpoint: each parameter allocated once on `device`, FP8 where `fp8_names` says
    (those also get their scales), else in dtype; the runtime names in `host` in pinned host memory
    instead (the n-gram tables with --ple-table host). Returns the runtime names held in FP8."""
    shapes = expected_shapes(cfg, layers, with_embed, with_head, with_mtp)
    with ExitStack() as stack:
        reader = CheckpointReader(Path(model_dir), cfg, shapes, stack)
        capable = fp8_capable(module, prefix).__contains__
        fp8 = reader.fp8_names(capable, quantization, torch.device(device))
        int4 = reader.int4_names(capable, quantization)
        strip = len(prefix)
        materialize(module, device, dtype, {n[strip:] for n in fp8}, {n[strip:] for n in host},
                    {n[strip:]: spec for n, spec in int4.items()})  # fmt: skip
        params = {prefix + n: p.data for n, p in module.named_parameters()}
        reader.read_into(params, dtype)
    return fp8 | set(int4)


@contextmanager
def meta_device() -> Iterator[None]:
    """Build modules without memory (their parameters and buffers on the meta device; `materialize`)."""
    with torch.device("meta"):
        yield


def materialize(
    module: nn.Module,
    device: torch.device | str,
    dtype: torch.dtype,
    fp8: set[str],
    host: set[str] = frozenset(),
    int4: dict[str, tuple[int, torch.dtype, bool]] | None = None,
) -> None:
    """Give a meta-built module real storage on device: parameters named in `fp8` as FP8 (with their
    scales), those in `int4` as packed int4 (their (group, scale dtype, symmetric): with their scales and
    zero points), the others in dtype (uninitialised: a loader or a random fill follows), those in `host` in
    pinned host memory when device is a GPU; and its buffers recomputed (`init_buffers` of the modules
    that have them)."""
    int4 = int4 or {}
    for mod_name, m in module.named_modules():
        for name, p in list(m.named_parameters(recurse=False)):
            full = f"{mod_name}.{name}" if mod_name else name
            if full in fp8:
                fp8_parameters(m, name, device, full in host)
            elif full in int4:
                int4_parameters(m, name, device, *int4[full], host=full in host)
            else:
                t = empty_storage(p.shape, dtype, device, full in host)
                m._parameters[name] = nn.Parameter(t, False)
        if hasattr(m, "init_buffers"):
            m.init_buffers(device)
