"""MoE top-k routing (softmax, top-k, renormalise, cast) for CUDA, one launch per call.

Reference: the CPU path of `nextserve.ops.moe.route` (softmax in float32, a stable descending sort, the
first k, divided by their sum, cast to the logits' dtype).

# NOTE: one program per row of logits [T, E]. It loads the row into a BLOCK = next_pow2(E) vector,
# computes the softmax in float32 (max-subtract, exp, tl.sum, divide), then picks the top k by k rounds
# of argmax: the largest probability, and among equal ones the LOWEST expert index (an explicit
# min-over-matching-indices, not an implementation-defined order), which is then knocked out. So the ids
# come in descending probability, ties broken toward the lower expert, the rule of the CPU path (a stable
# descending sort) on every device. The k top probabilities are summed in that order, in float32.
# NOTE: why a row's bits never depend on T or on the rows beside it (C1): a program reads only its own
# row; BLOCK and num_warps depend on E alone (so every reduction tree is fixed by E); the row count T is
# `do_not_specialize`, so one compiled kernel serves every T, and T only sizes the grid. Nothing is
# read to the host, so a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pdl_args, pdl_start, sigmoid

MAX_EXPERTS = 4096  # the whole row lives in registers (16 float32 a thread at 8 warps)


@triton.jit(do_not_specialize=["T"])  # one compiled kernel whatever the row count
def _route(
    x_ptr, w_ptr, i_ptr,
    T, E, stride_xr,
    K: tl.constexpr, KB: tl.constexpr, BLOCK: tl.constexpr, NORMALIZE: tl.constexpr,
    SHARED: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < E
    x = tl.load(x_ptr + row * stride_xr + cols, mask=valid, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    p = tl.div_rn(e, tl.sum(e, axis=0))  # IEEE division (`/` is div.full, 2 ulp)
    p = tl.where(valid, p, -1.0)  # below every probability: padding is never picked
    slots = tl.arange(0, KB)
    top_w = tl.zeros([KB], dtype=tl.float32)
    top_i = tl.zeros([KB], dtype=tl.int32)
    total = 0.0
    for j in tl.static_range(K):
        m = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == m, cols, BLOCK), axis=0)  # ties: the lowest expert index
        idx = tl.minimum(idx, E - 1)  # only a NaN row matches nothing; keep its ids in range
        top_w = tl.where(slots == j, m, top_w)
        top_i = tl.where(slots == j, idx, top_i)
        total = total + m  # in descending order
        p = tl.where(cols == idx, -1.0, p)
    if NORMALIZE:
        top_w = tl.div_rn(top_w, total)
    out = row * (K + SHARED) + slots
    keep = slots < K
    tl.store(w_ptr + out, top_w.to(w_ptr.dtype.element_ty), mask=keep)
    tl.store(i_ptr + out, top_i.to(tl.int64), mask=keep)
    if SHARED:  # the shared expert: id E, weight sigmoid(its gate logit), rounded as sigmoid_gate rounds
        gate = sigmoid(tl.load(x_ptr + row * stride_xr + E).to(tl.float32))
        first = slots == 0
        tl.store(w_ptr + out + K, tl.where(first, gate, 0.0).to(w_ptr.dtype.element_ty), mask=first)
        tl.store(i_ptr + out + K, tl.where(first, E, 0).to(tl.int64), mask=first)


def triton_route(
    logits: torch.Tensor, top_k: int, normalize: bool, shared: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (bf16/fp16/fp32; rows may be strided) -> (weights [T, k] in logits' dtype, expert
    ids [T, k] int64): the top-k softmax probabilities in descending order (ties: lower expert first),
    divided by their float32 sum when `normalize`. With `shared`, logits [T, E + 1] end with the shared
    expert's gate logit and the outputs get a last column (id E, sigmoid(logit))."""
    assert logits.dim() == 2, logits.shape
    T, E = logits.shape
    E -= int(shared)
    assert 0 < top_k <= E <= MAX_EXPERTS, (top_k, E)
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    weights = torch.empty(T, top_k + shared, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(T, top_k + shared, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    block = triton.next_power_of_2(E)
    num_warps = max(1, min(8, block // 512))
    _route[(T,)](
        x, weights, ids,
        T, E, x.stride(0),
        K=top_k, KB=triton.next_power_of_2(top_k), BLOCK=block, NORMALIZE=normalize, SHARED=shared,
        num_warps=num_warps, **pdl_args(x),
    )  # fmt: skip
    return weights, ids
