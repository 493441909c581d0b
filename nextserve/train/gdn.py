"""Chunked gated delta rule for training: the token recurrence of ops/gdn.py, computed 64 tokens at a time.

Within a chunk the delta-rule updates are solved in closed form (WY representation, one unit-lower-
triangular solve); across chunks the state is carried. Same maths as transformers'
`torch_chunk_gated_delta_rule`, batched over [B, T] and differentiable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.norms import l2_norm


def chunk_gated_delta_rule(*args, **kw) -> torch.Tensor:
    """See _chunk_gated_delta_rule; always computed in float32 (or float64), never under autocast."""
    device_type = args[0].device.type
    with torch.autocast(device_type=device_type, enabled=False):
        return _chunk_gated_delta_rule(*args, **kw)


def _chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int = 64,
) -> torch.Tensor:
    """q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv]. Zero initial state.

    Returns o [B, T, Hv, dv] in v's dtype (computed in float32, or float64 for float64 inputs).
    q, k are L2-normalised and q scaled by dk^-1/2 here, as in the reference recurrence."""
    out_dtype = v.dtype
    B, T, Hk, dk = k.shape
    Hv, dv = v.shape[2], v.shape[3]
    if Hk != Hv:
        q = q.repeat_interleave(Hv // Hk, dim=2)
        k = k.repeat_interleave(Hv // Hk, dim=2)
    ct = torch.float64 if v.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (t.to(ct) for t in (q, k, v, g, beta))
    q = l2_norm(q) * dk**-0.5
    k = l2_norm(k)
    # -> [B, H, T, d]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)
    pad = (chunk - T % chunk) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    q, k, v = (t.reshape(B, Hv, n, chunk, t.shape[-1]) for t in (q, k, v))
    g = g.reshape(B, Hv, n, chunk).cumsum(-1)
    beta = beta.reshape(B, Hv, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    tril = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    strict = tril.clone().fill_diagonal_(False)
    diff = g[..., :, None] - g[..., None, :]
    decay = torch.where(tril, diff, torch.full_like(diff, -torch.inf)).exp()  # [B,H,n,C,C]
    # (I + strict_lower(beta k k^T decay)) W = [v_beta | k_beta e^g]
    a = (k_beta @ k.transpose(-1, -2)) * decay
    m = torch.where(strict, a, torch.zeros_like(a)) + torch.eye(chunk, device=q.device, dtype=ct)
    rhs = torch.cat([v_beta, k_beta * g.exp()[..., None]], dim=-1)
    w = torch.linalg.solve_triangular(m, rhs, upper=False, unitriangular=True)
    u, w_k = w[..., :dv], w[..., dv:]
    S = q.new_zeros(B, Hv, dk, dv)
    outs = []
    for i in range(n):
        q_i, k_i, g_i = q[:, :, i], k[:, :, i], g[:, :, i]
        intra = torch.where(
            tril, (q_i @ k_i.transpose(-1, -2)) * decay[:, :, i], torch.zeros_like(decay[:, :, i])
        )
        v_new = u[:, :, i] - w_k[:, :, i] @ S
        outs.append((q_i * g_i.exp()[..., None]) @ S + intra @ v_new)
        g_last = g_i[..., -1]
        S = (
            S * g_last.exp()[..., None, None]
            + (k_i * (g_last[..., None] - g_i).exp()[..., None]).transpose(-1, -2) @ v_new
        )
    o = torch.stack(outs, dim=2).reshape(B, Hv, n * chunk, dv)[:, :, :T]
    return o.transpose(1, 2).to(out_dtype)
