"""Build transformers' Qwen4ExpForCausalLM on small random configs and load its weights into nextserve."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["indexed_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=False,
    rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5,
                         mrope_section=[3, 3, 2], mrope_interleaved=True),
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=6, output_gate_type="sigmoid",
    hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    norm_topk_prob=True, hc_count=4, hc_lowrank=8,
    ple_layer_ids=[1, 3], ple_embed_dim=32, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=2,
    ngram_vocab_size_base=101, make_ngram_vocab_size_divisible_by=4, split_ngram_parts=1, seed=1234,
    eos_token_id=1, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=8,
    indexer_compress_ratio=4,
)  # fmt: skip

# A second shape: 8 layers (two QSA), SiLU output gate, three-way GQA, a wider budget, c = 2.
WIDE = dict(
    TINY, hidden_size=48, num_hidden_layers=8,
    layer_types=(["linear_attention"] * 3 + ["indexed_attention"]) * 2,
    num_attention_heads=6, num_key_value_heads=2, head_dim=16, output_gate_type="silu",
    rope_parameters=dict(rope_type="default", rope_theta=1e5, partial_rotary_factor=1.0,
                         mrope_section=[3, 3, 2], mrope_interleaved=True),
    linear_num_key_heads=1, linear_num_value_heads=3, num_experts=6, num_experts_per_tok=3,
    ple_layer_ids=[2], ple_embed_dim=36, heads_per_ngram=3, ngram_size=4, hc_count=3,
    indexer_n_heads=3, indexer_head_dim=16, indexer_budget=6, indexer_compress_ratio=2, eos_token_id=5,
)  # fmt: skip


def hf_model(cfg: dict, seed: int, dtype: torch.dtype = torch.float32):
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**cfg, attn_implementation="eager"))
    # NOTE: the default init zeroes the (1+w) norms and the PLE conv, which would hide those paths.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or "hc_norm" in name or "norm_" in name:
                p.normal_(0.0, 0.2)
            elif "ple.conv1d" in name or "linear_attn.conv1d" in name:
                p.normal_(0.0, 0.3)
            elif "ngram_embedding" in name:
                p.normal_(0.0, 1.0)
    model.set_experts_implementation("eager")
    return model.to(dtype).eval()


def save_hf_model(cfg: dict, seed: int, out: Path) -> Path:
    """transformers' reference model of cfg saved as a model directory at out, its lm_head scaled by 30 so
    greedy decoding is not decided by near-ties."""
    hf = hf_model(cfg, seed)
    with torch.no_grad():
        hf.lm_head.weight.mul_(30)
    hf.save_pretrained(out)
    return out


def runtime_state(hf) -> dict[str, torch.Tensor]:
    """transformers' runtime names minus the `model.` prefix (buffers dropped): nextserve's names."""
    out = {}
    for k, v in hf.state_dict().items():
        if any(b in k for b in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")):
            continue
        out[k.removeprefix("model.")] = v
    return out


def nextserve_model(hf, dtype: torch.dtype, with_mtp: bool = False):
    """nextserve's FlashNext with the same weights as a transformers model."""
    from nextserve.config import ModelConfig
    from nextserve.model.flash_next import FlashNext

    cfg = ModelConfig.from_dict(hf.config.to_dict())
    model = FlashNext(cfg).to(dtype)
    model.load_state_dict(runtime_state(hf), strict=True)
    return cfg, model.eval()


def new_sequence(cfg, dtype: torch.dtype, tokens: int, page_size: int = 16, slots: int = 1):
    """A SequenceCache on a pool just big enough for `tokens` (MTP planes included)."""
    from nextserve.cache.kv_pool import KVPool
    from nextserve.cache.sequence import SequenceCache
    from nextserve.cache.states import StateSlots

    n_attn = len(cfg.qsa_layers) + 1
    pool = KVPool(cfg, n_attn, -(-tokens // page_size) * slots + 1, page_size, dtype)
    seq = SequenceCache(pool, StateSlots(cfg, slots, n_attn, dtype))
    seq.reserve(tokens)
    return seq


def run_serial(model, seq, prompt: torch.Tensor, chunk: int, new_tokens: int = 0):
    """The serial reference by hand: the prompt in grid chunks of `chunk`, then `new_tokens` greedy
    tokens one per forward. Returns (ids [P+new], streams [P+new-1 or P, nH], logits rows)."""
    from nextserve.model.batch import ForwardBatch, SeqChunk

    P = prompt.shape[0]
    ids, streams = prompt.clone(), []

    def forward(s: int, e: int) -> torch.Tensor:
        batch = ForwardBatch(
            ids[s:e], torch.arange(s, e), [SeqChunk(seq, s, e - s)], row_invariant=e - s == 1
        )
        x = model(batch)
        streams.append(x)
        return x

    with torch.no_grad():
        for s in range(0, P, chunk):
            last = forward(s, min(s + chunk, P))
        for t in range(P, P + new_tokens):
            ids = torch.cat([ids, model.logits(last[-1:]).argmax(-1)])
            if t + 1 < P + new_tokens:
                last = forward(t, t + 1)
        x = torch.cat(streams)
        return ids, x, model.logits(x, row_invariant=True)
