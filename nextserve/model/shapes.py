"""The runtime tensors a Flash-Next model (or one pipeline stage of it) holds, and their shapes, from the
config alone: what the loader reads into, and what benchmarks draw at random.

Runtime names are transformers' runtime state-dict names with the `model.` / `model.language_model.`
prefix stripped: experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and
`mlp.experts.down_proj` [E, H, I]), each PLE table whole, and the MTP block's single layer named
`mtp.layer.`. FP8 weights add `<name>_scale_inv` beside them (model/loader.py).
"""

from __future__ import annotations

from nextserve.config import GDN, ConfigError, ModelConfig
from nextserve.model.ple import table_rows as ple_table_rows

MTP_LAYER_RUNTIME = "mtp.layer."
Shape = tuple[int, ...]


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
    p = MTP_LAYER_RUNTIME
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
