"""Causal depthwise convolution over time with a carried history."""

import torch


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
