"""The training forward (nextserve/train) computes what transformers' Qwen4ExpForCausalLM computes, and
its MTP what the MTP oracle of tests/model/test_mtp.py computes: training trains the served model."""

import pytest
import torch
from hf_oracle import TINY, WIDE, hf_model, runtime_state

from nextserve.config import ModelConfig
from nextserve.train.model import FlashNextLM


def _gnorm(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.float())).to(x.dtype)


def _mtp_oracle(hf, mtp, streams, next_ids):
    """FLASH_NEXT.md section 2 around transformers' own QSA decoder layer (as tests/model/test_mtp.py)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextDecoderLayer

    cfg = hf.config
    layer = Qwen4ExpTextDecoderLayer(cfg, cfg.layer_types.index("indexed_attention")).to(streams.dtype).eval()
    layer.load_state_dict(dict(mtp.layer.state_dict()), strict=True)
    T, n, H = streams.shape[0], cfg.hc_count, cfg.hidden_size
    h = _gnorm(streams, mtp.pre_fc_norm_hidden.weight).view(T, n, H) @ mtp.fc_hidden.weight.t()
    e = _gnorm(hf.model.embed_tokens(next_ids), mtp.pre_fc_norm_embedding.weight)
    x = (h + (e @ mtp.fc_embedding.weight.t())[:, None, :]).reshape(1, T, n * H)
    pos = torch.arange(T).view(1, 1, T).expand(3, 1, T)
    mask = torch.full((T, T), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)[None, None]
    multi = layer(x, position_embeddings=hf.model.rotary_emb(x, pos), attention_mask=mask)[0]
    m = mtp.hyper_connection_mixer
    xn = torch.stack([_gnorm(multi.view(T, n, H)[:, s], m.hc_norm.weight.view(n, H)[s]) for s in range(n)], 1)
    a = torch.nn.functional.silu(xn.reshape(T, n * H) @ m.input_mix_weight_down.weight.t() / n)
    gate = torch.sigmoid(a @ m.input_mix_weight_up.weight.t()).view(T, n, H)
    return (gate * xn).mean(1) @ hf.lm_head.weight.t()


# transformers computes norms, rotary tables and the GDN recurrence in float32 whatever the dtype.
TOL = 5e-7


def _no_ties(lm, ids) -> None:
    """Every top-k the indexers make on `ids` has a strict gap at the boundary."""
    from nextserve.train import layers

    seen = []
    orig = layers.indexer_selection

    def spy(m, u, cos, sin, inv_f):
        out = orig(m, u, cos, sin, inv_f)
        seen.append(out[1])
        return out

    layers.indexer_selection = spy
    try:
        lm(ids)
    finally:
        layers.indexer_selection = orig
    for scores in seen:
        k = None
        for lay in lm.model.layers.values():
            if not lay.is_gdn:
                k = lay.self_attn.indexer.topk
        if scores.shape[-1] <= k:
            continue
        top = scores.topk(k + 1, dim=-1).values
        rows = torch.isfinite(top[..., k])
        assert (top[..., k - 1][rows] > top[..., k][rows]).all()


@pytest.mark.parametrize("shape", ["tiny", "wide"])
def test_training_forward_matches_transformers_and_mtp_oracle(shape) -> None:
    pytest.importorskip("transformers.models.qwen4_exp")
    dtype = torch.float64
    # NOTE: eight indexer heads, so a block's relu score is rarely exactly 0: ties at 0 make the top-k
    # implementation-defined (FLASH_NEXT.md), and _no_ties below checks the selection is unambiguous.
    raw = dict(TINY if shape == "tiny" else WIDE, indexer_n_heads=8)
    hf = hf_model(raw, seed=5, dtype=dtype)
    cfg = ModelConfig.from_dict(hf.config.to_dict())
    lm = FlashNextLM(cfg).to(dtype)
    lm.model.load_state_dict(runtime_state(hf), strict=True)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in lm.mtp.parameters():
            p.copy_(
                torch.randn(p.shape, generator=g, dtype=dtype)
                * (0.2 if p.dim() == 1 else p.shape[-1] ** -0.5)
            )
    B, T = 3, 70  # past the indexer budget, so the selection is sparse; crosses a 64-token GDN chunk
    eos = cfg.eos_token_id
    ids = torch.randint(2, cfg.vocab_size, (B, T), generator=g)
    ids[0, [8, 9, 20]] = eos  # adjacent eos and a lone one exercise the PLE reset
    ids[2, [1, 40, 64]] = eos
    lm.eval()
    with torch.no_grad():
        _no_ties(lm, ids)
        logits, mtp_logits = lm(ids)
        for b in range(B):
            ref = hf(ids[b : b + 1]).logits[0]
            assert (logits[b] - ref).abs().max() / ref.abs().max() < TOL
            streams = lm.trunk(ids[b : b + 1])[0]
            ref_mtp = _mtp_oracle(hf, lm.mtp, streams[:-1], ids[b, 1:])
            assert (mtp_logits[b] - ref_mtp).abs().max() / ref_mtp.abs().max() < TOL


def test_training_step_reduces_loss() -> None:
    from hf_oracle import TINY as t

    from nextserve.model.presets import full_config
    from nextserve.train.model import init_weights

    cfg = ModelConfig.from_dict(full_config(dict(t), "text", torch.float32))
    lm = FlashNextLM(cfg)
    init_weights(lm, 0)
    ids = torch.randint(2, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        aux: dict = {}
        logits, mtp_logits = lm(ids, aux)
        V = cfg.vocab_size
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
        loss = loss + 0.3 * torch.nn.functional.cross_entropy(
            mtp_logits[:, :-1].reshape(-1, V), ids[:, 2:].reshape(-1)
        )
        loss = loss + 0.01 * aux["balance"] + aux["indexer"]
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in lm.parameters() if "block_inject" not in p.__repr__())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
