"""Gated delta rule (GDN) recurrence, the token-by-token reference."""

import functools

import torch
import torch.nn.functional as F

from .norms import l2_norm
from .pointwise import rowwise
from .triton import use_kernel


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv]; state [Hv, dk, dv] float32.

    Returns (o [T, Hv, dv] in v's dtype, new state float32). Computes in float32; q and k are
    L2-normalised here and q scaled by dk^-1/2. Key head j serves value heads j*r .. j*r+r-1.

    # NOTE: each token is one step of S <- e^g S; S += k (beta (v - S^T k))^T; o = S^T q.
    # On CUDA, a 16-bit chunk of FLA_MIN_TOKENS or more runs flash-linear-attention's chunked algorithm
    # (`fla_gated_delta_rule`: tensor-core blocks of 64 tokens, the state passed between blocks), where
    # the token-by-token kernel keeps 48 heads' programs busy one token after another (383 ms of a
    # 1.33 s 62.7K-token prefill on the H200, BENCHMARKS.md, Long prefill). Otherwise (float32, short
    # chunks, fla not installed) one Triton launch (ops/triton/gdn_chunk.py) runs the decode kernel's
    # per-token code with the state tile in registers (tests/ops/test_gdn_chunk.py compares it with
    # recurrent_step); elsewhere this loop, both kernels' reference. Which path a chunk takes is a
    # function of its dtype and length: the serial reference and every resume run the same chunks
    # (snapshots on the chunk grid, C1), so they take the same path. Verify windows do not rely on any
    # of them agreeing with decode: they run `recurrent_window` (decode's kernel, token by token).
    """
    if use_kernel(q, k, v) and q.dtype != torch.float32 and q.shape[0] >= FLA_MIN_TOKENS and _fla_chunk():
        return fla_gated_delta_rule(q, k, v, g, beta, state)
    if use_kernel(q, k, v):
        from .triton.gdn_chunk import triton_gated_delta_rule

        return triton_gated_delta_rule(q, k, v, g, beta, state)
    return gated_delta_rule_reference(q, k, v, g, beta, state)


# NOTE: fla's call costs 1.35-1.55 ms of host time (nine autotuned Triton launches and fla's layers around
# them, H200), more than the token-by-token kernel's GPU time on chunks of ~1K tokens
# (a 1,024-token prompt prefilled at 30.8K tok/s with fla on every chunk of 64+, 34.8K without; H200,
# BENCHMARKS.md, Long prefill): fla from 2,048 on.
FLA_MIN_TOKENS = 2048

# NOTE: fla's L2 norm of q and k (inside its chunked call) is autotuned per NB = cdiv(rows, 2048 * 32) of
# its [tokens * key heads, dk] input (fla/modules/norm/l2norm.py, fla-core 0.6), and NB is a constexpr: at
# 16 key heads each 4,096 tokens of chunk length are another class, tuned and compiled at its first call
FLA_L2NORM_ROWS = 2048 * 32


def fla_tune_class(tokens: int, key_heads: int) -> int:
    """The autotune class of fla's L2 norm that a GDN chunk of `tokens` meets (0: fla does not run it)."""
    return 0 if tokens < FLA_MIN_TOKENS else -(-tokens * key_heads // FLA_L2NORM_ROWS)


@functools.cache
def _fla_chunk():
    """flash-linear-attention's chunked gated delta rule, or None where it is not installed (the `gpu`
    extra brings it)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def fla_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule` through fla's `chunk_gated_delta_rule` (one sequence as a batch of one; q and k
    L2-normalised in its kernel with the same eps, q scaled by dk^-1/2; g the natural-log decay; the
    state [Hv, dk, dv] float32 in and out, the input only read)."""
    chunk = _fla_chunk()
    o, new_state = chunk(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.float().unsqueeze(0), beta.unsqueeze(0),
        scale=q.shape[-1] ** -0.5, initial_state=state.float().unsqueeze(0).contiguous(),
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return o[0].to(v.dtype), new_state[0].float()


def gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule` as the token-by-token torch loop on any device (the CPU path, the kernel's
    reference)."""
    out_dtype = v.dtype
    Hk, Hv = k.shape[1], v.shape[1]
    if Hk != Hv:
        q = q.repeat_interleave(Hv // Hk, dim=1)
        k = k.repeat_interleave(Hv // Hk, dim=1)
    q, k, v, g, beta = (t.to(torch.float32) for t in (q, k, v, g, beta))
    q = l2_norm(q)
    k = l2_norm(k)
    q = q / (q.shape[-1] ** 0.5)
    S = state.to(torch.float32)
    outs = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        kv_mem = (S * k[t][:, :, None]).sum(dim=-2)  # [Hv, dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        outs.append((S * q[t][:, :, None]).sum(dim=-2))
    return torch.stack(outs).to(out_dtype), S


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One token per row. q, k [B, Hk, dk]; v [B, Hv, dv]; g, beta [B, Hv]; state [S, Hv, dk, dv] float32
    (a whole plane of slots, updated in place at rows `slots`); slots [B] int64 (distinct).
    Returns o [B, Hv, dv] in v.dtype.

    # On CUDA (not float64) this is one Triton launch (ops/triton/gdn_step.py) with no host reads, so
    # it can be captured in a CUDA graph; elsewhere it is this per-row loop over `gated_delta_rule`, the
    # kernel's reference and bit for bit the serial decode step.
    # NOTE: every row is its own `gated_delta_rule` call on its own slot (and the kernel gives every row
    # its own programs), so a row's output and its slot's new state never depend on the rows beside it.
    """
    if use_kernel(v) and state.dtype == torch.float32:
        from .triton.gdn_step import triton_recurrent_step

        return triton_recurrent_step(q, k, v, g, beta, state, slots)
    outs = []
    for b, s in enumerate(slots.tolist()):
        o, new_state = gated_delta_rule(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1], state[s]
        )
        state[s].copy_(new_state)
        outs.append(o)
    if not outs:
        return v.new_empty(v.shape)
    return torch.cat(outs, dim=0)


def gdn_gates(
    b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, row_invariant: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule's gates from the b, a projections [T, Hv]: (g = -exp(A_log) softplus(a + dt_bias)
    in float32, beta = sigmoid(b) in b's dtype). One Triton launch on CUDA (ops/triton/gates.py) in
    place of eight; this is its reference and the CPU path."""
    if use_kernel(b, a) and b.dim() == 2 and a_log.is_cuda and dt_bias.is_cuda:
        from .triton.gates import triton_gdn_gates

        return triton_gdn_gates(b, a, a_log, dt_bias)
    beta = rowwise(torch.sigmoid, b, row_invariant)
    g = -a_log.float().exp() * rowwise(F.softplus, a.float() + dt_bias, row_invariant)
    return g, beta


def recurrent_window(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """Row-invariant windows (verify windows), one sequence: its T tokens through `recurrent_step` one
    at a time on `state` [Hv, dk, dv] float32 (updated in place), so each row gets the bits a decode
    step at its position gets on every backend (the chunk kernel keeps the state in registers, and its
    float32 contractions need not be the step kernel's). Returns o [T, Hv, dv]."""
    plane = state.unsqueeze(0)  # [1, Hv, dk, dv]: a plane of one slot, a view of the state
    slot = torch.zeros(1, dtype=torch.long, device=q.device)
    outs = [
        recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], plane, slot)
        for t in range(q.shape[0])
    ]
    return torch.cat(outs, dim=0) if outs else v.new_empty(v.shape)
