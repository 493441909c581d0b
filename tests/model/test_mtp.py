"""The MTP block against an independent implementation written from FLASH_NEXT.md section 2, whose
decoder layer is transformers' own Qwen4ExpTextDecoderLayer (QSA type) with the MTP weights."""

import torch
from hf_oracle import TINY, hf_model, new_sequence, nextserve_model, run_serial

from nextserve.model.batch import ForwardBatch, SeqChunk
from nextserve.model.mtp import MTP


def _gnorm(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.float())).to(x.dtype)


def _oracle(hf, mtp: MTP, streams, next_ids):
    """MTP over rows 0..T-1 at positions 0..T-1, dense causal, written from the spec."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextDecoderLayer

    cfg = hf.config
    qsa = cfg.layer_types.index("indexed_attention")
    layer = Qwen4ExpTextDecoderLayer(cfg, qsa).to(streams.dtype).eval()
    layer.load_state_dict({k: v for k, v in mtp.layer.state_dict().items()}, strict=True)
    T, n, H = streams.shape[0], cfg.hc_count, cfg.hidden_size
    h = _gnorm(streams, mtp.pre_fc_norm_hidden.weight)  # joint over n*H
    h = h.view(T, n, H) @ mtp.fc_hidden.weight.t()
    e = _gnorm(hf.model.embed_tokens(next_ids), mtp.pre_fc_norm_embedding.weight)
    x = (h + (e @ mtp.fc_embedding.weight.t())[:, None, :]).reshape(1, T, n * H)
    pos = torch.arange(T).view(1, 1, T).expand(3, 1, T)
    cos_sin = hf.model.rotary_emb(x, pos)
    mask = torch.full((T, T), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)[None, None]
    multi = layer(x, position_embeddings=cos_sin, attention_mask=mask)[0]
    m = mtp.hyper_connection_mixer
    xn = torch.stack([_gnorm(multi.view(T, n, H)[:, s], m.hc_norm.weight.view(n, H)[s]) for s in range(n)], 1)
    a = torch.nn.functional.silu(xn.reshape(T, n * H) @ m.input_mix_weight_down.weight.t() / n)
    gate = torch.sigmoid(a @ m.input_mix_weight_up.weight.t()).view(T, n, H)
    logits = (gate * xn).mean(1) @ hf.lm_head.weight.t()
    return multi, logits


def test_mtp_prefill_and_draft_chain_match_oracle() -> None:
    dtype = torch.float64
    hf = hf_model(TINY, seed=11, dtype=dtype)
    with torch.no_grad():
        hf.lm_head.weight.mul_(30)
    cfg, model = nextserve_model(hf, dtype)
    mtp = MTP(cfg).to(dtype)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for p in mtp.parameters():
            scale = 0.2 if p.dim() == 1 else 1.0 / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * scale)
    prompt = torch.randint(2, 256, (40,), generator=g)
    prompt[[8, 9, 20]] = 1
    seq = new_sequence(cfg, dtype, 64)
    ids, streams, logits = run_serial(model, seq, prompt, chunk=16)
    T = ids.shape[0]
    nxt = int(logits[-1].argmax())
    next_ids = torch.cat([ids[1:], torch.tensor([nxt])])
    with torch.no_grad():
        # Draft prefill over rows 0..T-2, then a chain of 4 drafts from row T-1.
        batch = ForwardBatch(next_ids[: T - 1], torch.arange(T - 1), [SeqChunk(seq, 0, T - 1)], False)
        embed = torch.nn.functional.embedding(next_ids[: T - 1], model.embed_tokens.weight)
        multi = mtp(streams[: T - 1], embed, batch, model.rope(batch.positions, dtype))
        drafts, draft_logits = mtp.draft(model, streams[T - 1 :], nxt, T - 1, seq, k=4)
        ref_multi, _ = _oracle(hf, mtp, streams[: T - 1], next_ids[: T - 1])
        assert (multi - ref_multi).abs().max() < 1e-6
        # The chain, by the spec: row T-1+j takes step j-1's multi_hidden and draft.
        rows, toks, ref_drafts = [streams[: T - 1]], list(next_ids[: T - 1].tolist()), []
        state, tok = streams[T - 1 :], nxt
        for _ in range(4):
            rows.append(state)
            toks.append(tok)
            m_all, l_all = _oracle(hf, mtp, torch.cat(rows), torch.tensor(toks))
            state, tok = m_all[-1:], int(l_all[-1].argmax())
            ref_drafts.append(tok)
            ref_last_logits = l_all[-1]
    assert drafts == ref_drafts
    assert (draft_logits[-1] - ref_last_logits).abs().max() / ref_last_logits.abs().max() < 1e-6
