"""Vectorised, differentiable forwards of each Flash-Next block over a batch [B, T] of sequences that
all start at position 0. They read the parameters of nextserve's own inference modules
(nextserve.model.*), so a trained state dict is a nextserve state dict (runtime names).

Each function follows FLASH_NEXT.md section 1 exactly as the inference modules compute it, with the
per-row loops replaced by batched tensor ops (dense masks, a chunked GDN, dense MoE)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..model.decoder_layer import DecoderLayer
from ..model.gated_deltanet import GatedDeltaNet
from ..model.hyper import GatedResidual
from ..model.moe import SparseMoe
from ..model.ple import PLE
from ..model.qsa import QSAttention
from ..ops.norms import rms_norm, rms_norm_gated
from ..ops.rope import apply_rope, cos_sin
from .gdn import chunk_gated_delta_rule


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D]; cos/sin [T, rot]."""
    B, T = x.shape[:2]
    return apply_rope(x.reshape(B * T, *x.shape[2:]), cos.repeat(B, 1), sin.repeat(B, 1)).view_as(x)


def hc_block(hc: GatedResidual, x: torch.Tensor, block) -> torch.Tensor:
    """X_s <- X_s + inj_s * block(u): the inference GatedResidual, which is already shape-agnostic."""
    return hc(x, block, False)


def gdn_forward(m: GatedDeltaNet, u: torch.Tensor) -> torch.Tensor:
    """u [B, T, H] -> [B, T, H]. Causal depthwise conv (zero history) + SiLU, chunked delta rule."""
    B, T, _ = u.shape
    qkv = F.linear(u, m.in_proj_qkv.weight)  # [B, T, C]
    z = F.linear(u, m.in_proj_z.weight).view(B, T, m.hv, m.dv)
    beta = torch.sigmoid(F.linear(u, m.in_proj_b.weight))
    a = F.linear(u, m.in_proj_a.weight)
    g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
    w = m.conv1d.weight  # [C, 1, K]
    K = w.shape[-1]
    x = F.conv1d(F.pad(qkv.transpose(1, 2), (K - 1, 0)), w.to(qkv.dtype), groups=w.shape[0])
    x = F.silu(x.transpose(1, 2))
    kd = m.hk * m.dk
    q = x[..., :kd].reshape(B, T, m.hk, m.dk)
    k = x[..., kd : 2 * kd].reshape(B, T, m.hk, m.dk)
    v = x[..., 2 * kd :].reshape(B, T, m.hv, m.dv)
    o = chunk_gated_delta_rule(q, k, v, g, beta)
    o = rms_norm_gated(o, z, m.norm.weight, m.eps, m.gate_act)
    return F.linear(o.reshape(B, T, m.hv * m.dv), m.out_proj.weight)


def indexer_selection(
    m: QSAttention, u: torch.Tensor, cos, sin, inv_f: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The QSA indexer for all queries at once (FLASH_NEXT.md section 1).

    Returns (allowed [B, T, T] bool: the tokens each query attends to, scores [B, T, nb] (block
    scores, -inf where not visible), visible [T, nb] bool)."""
    ix = m.indexer
    B, T, _ = u.shape
    c, ni, di = ix.c, ix.ni, ix.di
    qk = F.linear(u, ix.index_qk_proj.weight)
    q = _rope(rms_norm(qk[..., : ni * di].view(B, T, ni, di), ix.q_layernorm.weight, ix.eps), cos, sin)
    raw = qk[..., ni * di :]  # [B, T, di]
    nb = T // c
    device = u.device
    t = torch.arange(T, device=device)
    n_vis = (t + 1) // c  # complete blocks visible to query t
    if nb > 0:
        pooled = raw[:, : nb * c].float().reshape(B, nb, c, di).mean(dim=2).to(raw.dtype)
        normed = rms_norm(pooled, ix.k_layernorm.weight, ix.eps)
        bcos, bsin = cos_sin(torch.arange(nb, device=device) * c, inv_f, raw.dtype)
        kbar = _rope(normed[:, :, None, :], bcos, bsin)[:, :, 0, :]  # [B, nb, di]
        scores = torch.relu(torch.einsum("bthd,bjd->bthj", q.float(), kbar.float())).sum(2) / math.sqrt(di)
        visible = torch.arange(nb, device=device)[None, :] < n_vis[:, None]  # [T, nb]
        scores = scores.masked_fill(~visible, -torch.inf)
        kk = min(ix.topk, nb)
        # NOTE: ties (relu scores of exactly 0) go to the lower block, as in serving (ops/attention.py).
        top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :kk]
        chosen = torch.zeros(B, T, nb, dtype=torch.bool, device=device).scatter_(-1, top, True)
        chosen = chosen & visible  # rows with < topk visible blocks take them all
        tok_sel = chosen.repeat_interleave(c, dim=-1)  # [B, T, nb*c]
        tok_sel = F.pad(tok_sel, (0, T - nb * c))
    else:
        scores = u.new_zeros(B, T, 0)
        visible = torch.zeros(T, 0, dtype=torch.bool, device=device)
        tok_sel = torch.zeros(B, T, T, dtype=torch.bool, device=device)
    s = t[None, :]
    tail = (s >= (n_vis * c)[:, None]) & (s <= t[:, None])  # open block [n_t c, t]
    return tok_sel | tail[None], scores, visible


def qsa_forward(
    m: QSAttention, u: torch.Tensor, cos, sin, inv_f: torch.Tensor, aux: dict | None = None
) -> torch.Tensor:
    """u [B, T, H] -> [B, T, H]: gated softmax attention over the indexer's selection.

    With `aux`, adds aux["indexer"]: KL(dense attention's block mass || indexer block distribution),
    the indexer's own training signal (its top-k selection passes no gradient). The indexer sees a
    detached input for that loss, so it never pulls the trunk."""
    B, T, _ = u.shape
    nq, nkv, d = m.nq, m.nkv, m.d
    allowed, _, _ = indexer_selection(m, u, cos, sin, inv_f)
    qg = F.linear(u, m.q_proj.weight).view(B, T, nq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(B, T, nq * d)
    q = _rope(rms_norm(q, m.q_norm.weight, m.eps), cos, sin)
    k = _rope(rms_norm(F.linear(u, m.k_proj.weight).view(B, T, nkv, d), m.k_norm.weight, m.eps), cos, sin)
    v = F.linear(u, m.v_proj.weight).view(B, T, nkv, d)
    rep = nq // nkv
    qh = q.transpose(1, 2)  # [B, nq, T, d]
    kh = k.repeat_interleave(rep, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(rep, dim=2).transpose(1, 2)
    logits = (qh @ kh.transpose(-1, -2)) * m.scaling  # [B, nq, T, T]
    probs = torch.softmax(logits.float().masked_fill(~allowed[:, None], -torch.inf), dim=-1).to(q.dtype)
    o = (probs @ vh).transpose(1, 2).reshape(B, T, nq * d) * torch.sigmoid(gate)
    if aux is not None:
        aux["indexer"] = aux.get("indexer", 0.0) + _indexer_loss(m, u, logits, cos, sin, inv_f)
    return F.linear(o, m.o_proj.weight)


def _indexer_loss(m: QSAttention, u, logits, cos, sin, inv_f) -> torch.Tensor:
    c = m.indexer.c
    B, _, T, _ = logits.shape
    nb = T // c
    if nb == 0:
        return logits.new_zeros(())
    _, scores, visible = indexer_selection(m, u.detach(), cos, sin, inv_f)
    with torch.no_grad():
        causal = torch.ones(T, T, dtype=torch.bool, device=u.device).tril()
        p = torch.softmax(logits.detach().float().masked_fill(~causal, -torch.inf), dim=-1)
        mass = p[..., : nb * c].reshape(B, -1, T, nb, c).sum(-1).sum(1)  # [B, T, nb]
        mass = mass.masked_fill(~visible, 0.0)
        target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-9)
        # NOTE: smoothed towards uniform so unattended blocks are not driven to a relu score of exactly
        # 0: exact ties make the top-k implementation-defined, and training and serving could differ.
        n_vis = visible.sum(-1, keepdim=True).clamp_min(1)
        target = (0.8 * target + 0.2 / n_vis) * visible
    rows = visible.any(-1)  # queries with at least one visible block
    logp = torch.log_softmax(scores.float(), dim=-1).masked_fill(~visible, 0.0)
    kl = (target * (target.clamp_min(1e-9).log() - logp)).sum(-1)  # [B, T]
    return kl[:, rows].mean()


def moe_forward(m: SparseMoe, u: torch.Tensor, aux: dict | None = None) -> torch.Tensor:
    """u [B, T, H] -> [B, T, H]. Routing as ops/moe.route; experts computed densely and combined with
    the top-k weights (zero for the others), which is the same sum. Adds a Switch-style
    load-balancing loss E * sum_e f_e P_e to aux["balance"]."""
    shape = u.shape
    x = u.reshape(-1, shape[-1])
    E = m.gate.weight.shape[0]
    logits = F.linear(x, m.gate.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    # ties to the lower expert index, as ops/moe.route on every device (torch.topk leaves their order open)
    top_i = torch.sort(probs, dim=-1, descending=True, stable=True).indices[..., : m.top_k].contiguous()
    top_w = probs.gather(-1, top_i)
    if m.norm_topk:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    top_w = top_w.to(logits.dtype)
    combine = torch.zeros(x.shape[0], E, dtype=x.dtype, device=x.device).scatter(-1, top_i, top_w.to(x.dtype))
    gu = torch.einsum("nh,eih->eni", x, m.experts.gate_up_proj)  # [E, N, 2I]
    gate, up = gu.chunk(2, dim=-1)
    y = torch.einsum("eni,ehi->enh", F.silu(gate) * up, m.experts.down_proj)  # [E, N, H]
    routed = torch.einsum("enh,ne->nh", y, combine)
    sh = m.shared_expert
    shared = F.linear(
        F.silu(F.linear(x, sh.gate_proj.weight)) * F.linear(x, sh.up_proj.weight), sh.down_proj.weight
    )
    out = routed + torch.sigmoid(F.linear(x, m.shared_expert_gate.weight)) * shared
    if aux is not None:
        frac = (
            torch.zeros(E, device=x.device).scatter_add_(
                0, top_i.flatten(), torch.ones(top_i.numel(), device=x.device)
            )
            / top_i.numel()
        )
        aux["balance"] = aux.get("balance", 0.0) + E * (frac * probs.mean(0)).sum()
    return out.view(shape)


def ngram_contexts_batch(ids: torch.Tensor, N: int, eos: int) -> torch.Tensor:
    """ids [B, T] (each row starts at position 0) -> contexts [B, T, N], the eos-reset rule of
    model/ple.ngram_contexts: c^s = token_{t-s}, or eos if t-s < 0 or an eos lies strictly between."""
    B, T = ids.shape
    hist = torch.cat([ids.new_full((B, N - 1), eos), ids], dim=1)
    ctx = N - 1
    cols = [ids]
    blocked = torch.zeros(B, T, dtype=torch.bool, device=ids.device)
    for s in range(1, N):
        prev = hist[:, ctx - s : ctx - s + T]
        cols.append(torch.where(blocked, torch.full_like(prev, eos), prev))
        blocked = blocked | (prev == eos)
    return torch.stack(cols, dim=-1)


def ple_forward(m: PLE, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x [B, T, nH] -> PLE contribution [B, T, nH] (gated value + dilated conv)."""
    B, T, nH = x.shape
    n, H = m.n, m.hidden
    emb = m.ple_embedding
    rows = emb.ids(ngram_contexts_batch(ids, m.N, emb.eos).reshape(B * T, m.N)).view(B, T, -1)
    e_vec = F.embedding(rows, emb.ngram_embedding.weight).flatten(-2)  # [B, T, D]
    key = rms_norm(F.linear(e_vec, m.key_proj.weight), m.norm_key.weight, m.eps, H)
    value = F.linear(e_vec, m.value_proj.weight)
    query = rms_norm(x, m.norm_query.weight, m.eps, H)
    d = (key.view(B, T, n, H) * query.view(B, T, n, H)).sum(-1, keepdim=True) / math.sqrt(H)
    gate = d.abs().clamp_min(1e-6).sqrt() * d.sign()
    gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
    normed = rms_norm(gated, m.norm_conv.weight, m.eps, H)
    w = m.conv1d.weight  # [nH, 1, K]
    K = w.shape[-1]
    conv = F.conv1d(
        F.pad(normed.transpose(1, 2), ((K - 1) * m.N, 0)), w.to(normed.dtype), groups=nH, dilation=m.N
    )
    return gated + F.silu(conv.transpose(1, 2))


def layer_forward(
    layer: DecoderLayer, x: torch.Tensor, ids: torch.Tensor, rope, aux: dict | None = None
) -> torch.Tensor:
    """One decoder layer over streams x [B, T, nH]: [PLE] -> HC(GDN | QSA) -> HC(MoE)."""
    cos, sin, inv_f = rope
    if layer.ple is not None:
        x = x + ple_forward(layer.ple, x, ids)
    if layer.is_gdn:
        x = hc_block(layer.attn_hyper_connection, x, lambda u: gdn_forward(layer.linear_attn, u))
    else:
        x = hc_block(
            layer.attn_hyper_connection, x, lambda u: qsa_forward(layer.self_attn, u, cos, sin, inv_f, aux)
        )
    return hc_block(layer.mlp_hyper_connection, x, lambda u: moe_forward(layer.mlp, u, aux))
