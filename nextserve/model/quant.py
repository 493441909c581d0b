"""The quantization of a checkpoint: what its config.json's `quantization_config` says, checked, and which
modules nextserve stores in FP8.

Two formats of block-wise FP8 E4M3 (128 x 128 blocks, one float32 multiplier a block, w ~= q * s) are read,
as they ship:
- transformers' FineGrainedFP8 / Qwen's and DeepSeek's releases: `quant_method: "fp8"`,
  `weight_block_size: [128, 128]`, `activation_scheme: "dynamic"`, `modules_to_not_convert`; tensors
  `<module>.weight` (float8_e4m3fn) and `<module>.weight_scale_inv`;
- compressed-tensors' FP8_BLOCK as llm-compressor writes it: `quant_method: "compressed-tensors"`, a
  config group of 8-bit float weights with strategy `block` and `block_structure: [128, 128]`, an
  `ignore` list; tensors `<module>.weight` and `<module>.weight_scale`.
Anything else (another method, block size or `fmt`, static activation scales, a quantized KV cache) is a
ConfigError: a checkpoint is never silently cast. Activations stay in the model dtype: "dynamic" activation
quantization is the runtime's choice, and nextserve's kernels read FP8 weights with 16-bit activations.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError

# What `make-model --quantization fp8` and `--quantization fp8` leave unquantized, as FP8 releases do:
# embeddings, the LM head, the routers (and the shared expert's gate: one row), the norms and
# convolutions (not projections), the PLE table and the hyper-connections' mixing weights.
DEFAULT_NOT_CONVERTED = (
    "embed_tokens",
    "lm_head",
    "mlp.gate",
    "shared_expert_gate",
    "hyper_connection",
    "ngram_embedding",
)


@dataclass(frozen=True)
class Fp8Checkpoint:
    """A block-wise FP8 checkpoint's format: which name its scales go by, which modules it keeps as is."""

    fmt: str  # "fp8" (scales `weight_scale_inv`) or "compressed-tensors" (scales `weight_scale`)
    not_converted: tuple[str, ...] = ()

    def scale_name(self, name: str) -> str:
        """The checkpoint name of FP8 tensor `name`'s scales: `X.weight` -> `X.weight_scale_inv` (or
        compressed-tensors' `X.weight_scale`); fused experts `X.gate_up_proj` -> `X.gate_up_proj_scale_inv`
        (transformers' FP8 experts)."""
        suffix = "_scale_inv" if self.fmt == "fp8" else "_scale"
        return name + suffix

    def converted(self, module: str) -> bool:
        """Whether `module` (a checkpoint module name) is quantized by the config's lists."""
        return not any(_matches(module, pattern, self.fmt) for pattern in self.not_converted)


def _matches(module: str, pattern: str, fmt: str) -> bool:
    if pattern.startswith("re:"):  # compressed-tensors' regular expressions
        return re.match(pattern[3:], module) is not None
    if fmt == "compressed-tensors":
        return module == pattern or module.endswith("." + pattern)
    # transformers' modules_to_not_convert: a name, or a dotted part of one
    return module == pattern or f".{pattern}." in f".{module}."


def default_fp8() -> Fp8Checkpoint:
    """The scheme `--quantization fp8` quantizes by, and `make-model --quantization fp8` writes."""
    return Fp8Checkpoint("fp8", DEFAULT_NOT_CONVERTED)


def fp8_config_json() -> dict[str, Any]:
    """The quantization_config make-model writes for `default_fp8` (transformers' FineGrainedFP8 form)."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": list(DEFAULT_NOT_CONVERTED),
    }


@dataclass(frozen=True)
class Int4Checkpoint:
    """A W4A16 checkpoint (ops/int4.py): 4-bit integer weights in groups of `group` input columns (None: one
    group a row), symmetric or with zero points, and the modules it keeps as they are. `fmt`:
    - "pack-quantized", compressed-tensors as llm-compressor writes it: tensors `X.weight_packed`,
      `X.weight_scale`, `X.weight_shape` and, asymmetric, `X.weight_zero_point`;
    - "gptq" (AutoGPTQ's and GPTQModel's `checkpoint_format` "gptq", AutoRound's GPTQ export): `X.qweight`
      [K/8, N] (eight values along K to a word, lowest bits first, stored 0..15), `X.qzeros` [K/G, N/8]
      (packed along N, each stored one less than the zero point), `X.scales` [K/G, N], `X.g_idx` [K];
      "gptq_v2" (GPTQModel's own) stores the zero points as they are. A module without `qweight` is not
      converted."""

    group: int | None
    symmetric: bool
    not_converted: tuple[str, ...] = ()
    fmt: str = "pack-quantized"

    def converted(self, module: str) -> bool:
        return not any(_matches(module, pattern, "compressed-tensors") for pattern in self.not_converted)


def read_quantization(qc: Any) -> Fp8Checkpoint | Int4Checkpoint | None:
    """The checked scheme of a config's quantization_config (None: not quantized)."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError("quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fine_grained(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "gptq":
        return _gptq(qc)
    raise ConfigError(
        f"quantization_config quant_method {method!r} is not supported: nextserve reads block-wise FP8 "
        "checkpoints (quant_method 'fp8' with weight_block_size [128, 128], or compressed-tensors "
        "FP8_BLOCK) and W4A16 ones (compressed-tensors pack-quantized, or GPTQ); serve the unquantized "
        "checkpoint, or one of those"
    )


GPTQ_FORMATS = ("gptq", "gptq_v2")


def _gptq(qc: dict) -> Int4Checkpoint:
    """AutoGPTQ / GPTQModel / AutoRound GPTQ: 4 bits, one group size, no activation order."""
    bits = qc.get("bits")
    if bits != 4:
        raise ConfigError(f"GPTQ quantization_config bits {bits!r}: only 4-bit weights are read (W4A16)")
    group = qc.get("group_size", 128)
    if (
        not isinstance(group, int)
        or isinstance(group, bool)
        or not (group == -1 or (group > 0 and group % 8 == 0))
    ):
        raise ConfigError(f"GPTQ quantization_config group_size {group!r} is not -1 or a multiple of 8")
    if qc.get("desc_act", False):
        raise ConfigError(
            "GPTQ quantization_config desc_act true: activation-ordered weights (a permuting g_idx) are not "
            "read; use a checkpoint quantized with desc_act false (or its compressed-tensors W4A16 build)"
        )
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in GPTQ_FORMATS:
        raise ConfigError(f"GPTQ checkpoint_format {fmt!r} is not supported ({', '.join(GPTQ_FORMATS)})")
    sym = qc.get("sym", True)
    if not isinstance(sym, bool):
        raise ConfigError(f"GPTQ quantization_config sym {sym!r} is not true or false")
    if qc.get("dynamic"):
        raise ConfigError("GPTQ quantization_config dynamic (per-module overrides) is not supported")
    return Int4Checkpoint(None if group == -1 else group, sym, (), fmt)


def _fine_grained(qc: dict) -> Fp8Checkpoint:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config fmt {fmt!r} is not supported (only e4m3)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(
            f"quantization_config activation_scheme {scheme!r} is not supported: static activation scales "
            "are not read (only 'dynamic')"
        )
    block = qc.get("weight_block_size")
    if list(block or []) != [128, 128]:
        raise ConfigError(
            f"quantization_config weight_block_size {block!r} is not supported: nextserve's FP8 kernels "
            "read 128 x 128 blocks (per-tensor and per-channel FP8 are not read)"
        )
    skip = qc.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise ConfigError("quantization_config modules_to_not_convert must be a list of module names")
    return Fp8Checkpoint("fp8", tuple(skip))


def _compressed_tensors(qc: dict) -> Fp8Checkpoint | Int4Checkpoint:
    groups = qc.get("config_groups")
    if (
        isinstance(groups, dict)
        and groups
        and all(((g or {}).get("weights") or {}).get("type") == "int" for g in groups.values())
    ):
        return _pack_quantized(qc, groups)
    _check_compressed(qc)
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError("compressed-tensors quantization_config has no config_groups")
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        fp8_block = (
            w.get("type") == "float"
            and w.get("num_bits") == 8
            and w.get("strategy") == "block"
            and list(w.get("block_structure") or []) == [128, 128]
            and w.get("symmetric", True) is True
            and not w.get("dynamic", False)
        )
        if not fp8_block:
            raise ConfigError(
                f"compressed-tensors config group {name!r} is not FP8_BLOCK (8-bit float weights, strategy "
                f"block, block_structure [128, 128]): {w!r}"
            )
        inputs = (group or {}).get("input_activations")
        if inputs is not None and not inputs.get("dynamic", False):
            raise ConfigError(f"compressed-tensors config group {name!r} has static activation scales")
        fmt = group.get("format") or qc.get("format")
        if fmt not in (None, "float-quantized"):
            raise ConfigError(f"compressed-tensors format {fmt!r} is not supported ('float-quantized')")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(m, str) for m in ignore):
        raise ConfigError("compressed-tensors ignore must be a list of module names")
    return Fp8Checkpoint("compressed-tensors", tuple(ignore))


def _check_compressed(qc: dict) -> None:
    """What both compressed-tensors formats need: weights stored compressed, a 16-bit KV cache."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ConfigError(
            f"compressed-tensors quantization_status {status!r} is not supported ('compressed')"
        )
    if qc.get("kv_cache_scheme") is not None:
        raise ConfigError("compressed-tensors kv_cache_scheme is not supported (the KV cache stays 16-bit)")


def _pack_quantized(qc: dict, groups: dict) -> Int4Checkpoint:
    """compressed-tensors W4A16: every config group 4-bit integer weights, one grouping, no activation
    quantization, format pack-quantized."""
    _check_compressed(qc)
    seen = set()
    for name, group in groups.items():
        w = group["weights"]
        fmt = group.get("format") or qc.get("format")
        if fmt != "pack-quantized":
            raise ConfigError(
                f"compressed-tensors format {fmt!r} of int weights is not supported ('pack-quantized')"
            )
        if w.get("num_bits") != 4:
            raise ConfigError(
                f"compressed-tensors config group {name!r} has {w.get('num_bits')!r}-bit int weights: "
                "only 4-bit ones are read (W4A16)"
            )
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise ConfigError(
                f"compressed-tensors config group {name!r} strategy {strategy!r} is not 'group' or 'channel'"
            )
        size = w.get("group_size") if strategy == "group" else None
        if strategy == "group" and not (isinstance(size, int) and size > 0 and size % 8 == 0):
            raise ConfigError(
                f"compressed-tensors config group {name!r} group_size {size!r} is not a multiple of 8"
            )
        if w.get("actorder") not in (None, False):
            order = w["actorder"]
            raise ConfigError(
                f"compressed-tensors config group {name!r} actorder {order!r}: activation-ordered weights "
                "(a g_idx) are not read"
            )
        if w.get("dynamic", False):
            raise ConfigError(f"compressed-tensors config group {name!r} has dynamic weights")
        if (group or {}).get("input_activations") is not None:
            raise ConfigError(
                f"compressed-tensors config group {name!r} quantizes activations: only W4A16 (16-bit "
                "activations) is read"
            )
        seen.add((size, bool(w.get("symmetric", True))))
    if len(seen) != 1:
        raise ConfigError(
            f"compressed-tensors config groups differ in group size or symmetry: {sorted(seen)}"
        )
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(m, str) for m in ignore):
        raise ConfigError("compressed-tensors ignore must be a list of module names")
    ((size, symmetric),) = seen
    return Int4Checkpoint(size, symmetric, tuple(ignore))


def int4_config_json(group: int = 128) -> dict[str, Any]:
    """The quantization_config `make-model --quantization int4` writes: compressed-tensors W4A16 as
    llm-compressor writes it (symmetric int4 in groups of `group`, the modules DEFAULT_NOT_CONVERTED
    names left out)."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group,
               "dynamic": False, "actorder": None, "observer": "minmax"}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },  # fmt: skip
        "ignore": [f"re:.*{m}.*" for m in DEFAULT_NOT_CONVERTED],
        "kv_cache_scheme": None,
    }
