"""Causal depthwise convolution over time with a carried history."""

import torch
import torch.nn.functional as F

from .triton import use_kernel


def causal_conv(
    x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor, dilation: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv, no bias.

    x [T, C] new inputs; history [C, L] the last L = (K-1)*dilation inputs (oldest first);
    weight [C, K]. Returns (out [T, C], new history [C, L]).

    # NOTE: an explicit sum over taps in a fixed order (k = 0..K-1): every output row is computed
    # the same way whatever T is, so prefill and decode share one definition.
    """
    T = x.shape[0]
    K = weight.shape[-1]
    L = history.shape[-1]
    seq = torch.cat([history.t().to(x.dtype), x], dim=0)  # [L + T, C]
    w = weight.to(x.dtype)
    out = None
    for k in range(K):
        start = L - (K - 1 - k) * dilation
        term = seq[start : start + T] * w[:, k]
        out = term if out is None else out + term
    return out, seq[-L:].t().contiguous() if L else history


def conv_chunk(
    x: torch.Tensor,
    history: torch.Tensor,
    weight: torch.Tensor,
    dilation: int = 1,
    silu: bool = False,
    parts: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor]:
    """A prefill chunk's conv: `causal_conv`, optionally followed by SiLU. Returns (out [T, C], the new
    history [C, L]); the history passed in is not changed. With `parts` (three widths summing to C) out
    is the list of its three column ranges, each a contiguous [T, width] tensor.

    # On CUDA (not float64) one Triton launch over the chunk (ops/triton/conv_chunk.py: the taps in
    # float32, rounded once, as the decode step computes them), equal to this reference to rounding; it
    # stores the parts contiguous itself.
    """
    if use_kernel(x, weight):
        from .triton.conv_chunk import triton_conv_chunk

        L = history.shape[-1]
        out = triton_conv_chunk(x, history, weight, dilation, silu, parts)
        if L == 0:
            return out, history
        seq = (
            x[-L:].t()
            if x.shape[0] >= L
            else torch.cat([history[:, x.shape[0] :], x.t().to(history.dtype)], 1)
        )
        return out, seq.to(history.dtype).contiguous()
    out, new_history = causal_conv(x, history, weight, dilation)
    out = F.silu(out) if silu else out
    if parts is not None:
        out = [p.contiguous() for p in out.split(list(parts), dim=-1)]
    return out, new_history


def conv_step(
    x: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    dilation: int = 1,
    silu: bool = False,
) -> torch.Tensor:
    """One new input per row. x [B, C]; state [S, C, L] (L = (K-1)*dilation, a whole plane of slots,
    updated in place at rows `slots`); slots [B] int64 (distinct); weight [C, K].
    Returns out [B, C] in x.dtype, optionally followed by SiLU.

    # On CUDA (not float64) this is one Triton launch (ops/triton/conv_step.py) with no host reads, so
    # it can be captured in a CUDA graph; elsewhere it is this per-row loop over `causal_conv`, the
    # kernel's reference and bit for bit the serial decode step.
    # NOTE: every row is its own `causal_conv` call on its own slot (and the kernel gives every row its
    # own programs), so a row's output and its slot's new history never depend on the rows beside it.
    """
    if use_kernel(x):
        from .triton.conv_step import triton_conv_step

        return triton_conv_step(x, state, slots, weight, dilation, silu)
    outs = []
    for b, s in enumerate(slots.tolist()):
        out, new_hist = causal_conv(x[b : b + 1], state[s], weight, dilation)
        state[s].copy_(new_hist)
        outs.append(F.silu(out) if silu else out)
    if not outs:
        return x.new_empty(x.shape)
    return torch.cat(outs, dim=0)


def conv_window(
    x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor, dilation: int = 1, silu: bool = False
) -> torch.Tensor:
    """Row-invariant windows (verify windows): x [T, C] through `conv_step` one token at a time on
    `history` [C, L] (updated in place), so each row gets the bits a decode step at its position gets,
    on every backend (the CUDA decode kernel rounds as it does, not as `causal_conv` over T rows)."""
    state = history.unsqueeze(0)  # [1, C, L]: a plane of one slot, a view of the history
    slot = torch.zeros(1, dtype=torch.long, device=x.device)
    outs = [conv_step(x[t : t + 1], state, slot, weight, dilation, silu) for t in range(x.shape[0])]
    return torch.cat(outs, dim=0) if outs else x.new_empty(x.shape)
