"""Mixture of experts: top-k routing and the routed experts."""

import torch
import torch.nn.functional as F

from .cached_experts import CachedExperts
from .fp8 import Fp8Weight, w8a8_linear
from .linear import linear
from .pointwise import rowwise
from .triton import use_kernel


def weight_form(w) -> type:
    """The form the ops read weight w in (a tensor, an Fp8Weight, an Int4Weight): routed experts with a
    device cache (ops/cached_experts.py) are read in their host form, slot by slot."""
    w = w.host if isinstance(w, CachedExperts) else w
    return torch.Tensor if isinstance(w, torch.Tensor) else type(w)


def default_block_m(pairs: int, num_experts: int) -> int:
    """The grouped prefill kernel's BLOCK_M (ops/triton/moe_grouped.py) for n (token, expert) pairs over E
    experts: about the mean pairs per expert, 16 to 64 (the MMA rows of a mostly empty block are wasted;
    an expert with more pairs than BLOCK_M is cut into more blocks), and 128 (with 8 warps and gate/up tiles
    128 wide) from 64 pairs an expert on (a 4,096-token chunk of Flash-Next: 80). On the H200 that tile took
    a 4,096-token chunk's bf16 experts from 2,335 to 2,115 us and four chunks' together from 5,974 to 5,226
    (BENCHMARKS.md, Long prefill); FP8 gained 1.23x at 128 there. Each value is a kernel
    specialisation (engine/warmup.py compiles all); bf16 and FP8 experts take the same."""
    mean = pairs / max(num_experts, 1)
    if mean >= 64:
        return 128
    return 16 if mean <= 8 else 32 if mean <= 24 else 64


def route(
    logits: torch.Tensor, top_k: int, normalize: bool, row_invariant: bool = False, shared: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (model dtype) -> (weights [T, k] model dtype, expert ids [T, k] int64).

    The k largest softmax probabilities (float32) in descending order, ties to the lower expert index
    (torch.topk leaves the order of ties to the implementation), divided by their sum if `normalize`.
    With `shared`, logits [T, E + 1] end with the shared expert's gate logit, and the result gets a
    (k+1)-th column: id E, weight sigmoid(logit) in the model dtype (the shared expert as one more
    expert, the last in ascending id order: `experts(..., shared=...)`).

    # NOTE: on CUDA (bf16/fp16/fp32) this is one Triton launch (ops/triton/route.py), row-invariant by
    # construction and free of host reads; the code below (a stable descending sort, the first k) is its
    # reference and the CPU path, and train/layers.py routes by the same rule.
    """
    if use_kernel(logits):
        from .triton.route import triton_route

        return triton_route(logits, top_k, normalize, shared)
    routed = logits[..., :-1] if shared else logits
    probs = rowwise(lambda t: torch.softmax(t, dim=-1, dtype=torch.float), routed, row_invariant)
    top_i = torch.sort(probs, dim=-1, descending=True, stable=True).indices[..., :top_k].contiguous()
    top_w = probs.gather(-1, top_i)
    if normalize:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    top_w = top_w.to(logits.dtype)
    if not shared:
        return top_w, top_i
    E = routed.shape[-1]
    gate = rowwise(torch.sigmoid, logits[..., -1:], row_invariant)  # [T, 1] model dtype
    return torch.cat([top_w, gate], dim=-1), torch.cat([top_i, torch.full_like(top_i[..., :1], E)], dim=-1)


def experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    row_invariant: bool,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H] (gate rows first); down [E, H, I]. Returns sum_k w_k * y_{e_k}.
    `shared` = (gate_up [2I, H], down [H, I]) of one more expert, id E (the shared expert, whose weight
    `route(..., shared=True)` gives): added last, as sigmoid_gate(shared, gate, routed) adds it.

    # NOTE: contributions are added in ascending expert order, one expert at a time, as the
    # reference model does; in row-invariant mode each row's projections are calls of their own.
    # On CUDA (not float64) the row-invariant path is the grouped decode kernel with fixed blocks
    # (`grouped_decode_experts`, ops/triton/moe_grouped.py; on the H200 0.96x the per-pair GEMV kernel of
    # ops/triton/moe_decode.py at one row and 1.27x faster at 32: benchmarks/bench_kernels.py
    # moe_grouped_decode), with no host reads; `_experts_by_row` is its reference. On CUDA (not float64) the
    # grouped path is the same grouped GEMM with prefill's blocks (`grouped_experts`), also free of host
    # reads; the per-expert loop `_experts_by_expert` (one host sync an expert) is its reference and the
    # CPU path. Experts with a device cache (ops/cached_experts.py) count the call's routing first.
    """
    if isinstance(gate_up, CachedExperts):
        gate_up.count(ids)
    if row_invariant:
        if use_kernel(x):
            from .triton.moe_grouped import grouped_decode_experts

            return grouped_decode_experts(x, weights, ids, gate_up, down, shared=shared)
        return _experts_by_row(x, weights, ids, gate_up, down, shared)
    if use_kernel(x):
        from .triton.moe_grouped import grouped_experts

        return grouped_experts(x, weights, ids, gate_up, down, shared=shared)
    return _experts_by_expert(x, weights, ids, gate_up, down, shared)


def experts_of_chunks(
    xs: list[torch.Tensor],
    weights: list[torch.Tensor],
    ids: list[torch.Tensor],
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> list[torch.Tensor]:
    """The routed experts of several prefill chunks of equal length (xs[i] [n, H], weights[i] [n, k], ids[i]
    [n, k]), each chunk's rows with the bits `experts(xs[i], ..., row_invariant=False)` gives it alone.

    # NOTE: on CUDA one grouped call over every chunk's rows with the block sizes one chunk takes alone
    # (default_block_m of its n*k pairs): the grouped kernels compute a row from its own x row, its experts'
    # weights and those fixed blocks only (ops/triton/moe_grouped.py, the row-invariance NOTE), so the other
    # chunks' rows change where a pair lands in a block, not its bits; each active expert's weights are then
    # read once for all the chunks instead of once a chunk. Elsewhere (the CPU, float64: per-expert GEMMs
    # whose bits may follow their row count) one call a chunk, which is what each chunk gets alone."""
    n = xs[0].shape[0]
    assert all(x.shape[0] == n for x in xs), [x.shape for x in xs]
    if len(xs) == 1 or not use_kernel(xs[0]):  # (experts() counts a cache's routing)
        return [experts(x, w, i, gate_up, down, False) for x, w, i in zip(xs, weights, ids, strict=True)]
    from .triton.moe_grouped import grouped_experts

    if isinstance(gate_up, CachedExperts):
        gate_up.count(torch.cat(ids))
    block_m = default_block_m(ids[0].numel(), gate_up.shape[0])
    out = grouped_experts(torch.cat(xs), torch.cat(weights), torch.cat(ids), gate_up, down, block_m=block_m)
    return list(out.split(n))


def _expert(gate_up, down, shared, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's (gate_up [2I, H], down [H, I]); e == E is the shared expert."""
    return shared if shared is not None and e == gate_up.shape[0] else (gate_up[e], down[e])


def _experts_by_expert(x, weights, ids, gate_up, down, shared=None, w8a8: bool = False) -> torch.Tensor:
    """Grouped experts, one expert at a time in ascending id (a host sync an expert): the CPU path, and
    the reference of the CUDA grouped GEMM. `w8a8`: FP8 experts' projections as ops/fp8.py `w8a8_linear`
    wherever x is (what `linear` runs on a GPU with FP8 MMAs): the reference of the W8A8 prefill kernels."""
    out = torch.zeros_like(x)

    def project(rows: torch.Tensor, w) -> torch.Tensor:
        return w8a8_linear(rows, w) if w8a8 and isinstance(w, Fp8Weight) else linear(rows, w, False)

    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        gu, dn = _expert(gate_up, down, shared, e)
        h = project(x[tok], gu)
        g, u = h.chunk(2, dim=-1)
        y = project(rowwise(F.silu, g, False) * u, dn)
        out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
    return out


def _experts_by_row(x, weights, ids, gate_up, down, shared=None) -> torch.Tensor:
    """Row-invariant experts: each row on its own, its experts in ascending order, so a row's bits are
    those of the grouped path with one row. One host read of the routing, no per-expert syncs."""
    rows = []
    for r, row_ids in enumerate(ids.tolist()):
        xr, acc = x[r : r + 1], torch.zeros_like(x[r : r + 1])
        for slot, e in sorted(enumerate(row_ids), key=lambda pair: pair[1]):
            gu, dn = _expert(gate_up, down, shared, e)
            g, u = linear(xr, gu, True).chunk(2, dim=-1)
            y = linear(rowwise(F.silu, g, True) * u, dn, True)
            acc = acc + (y * weights[r : r + 1, slot, None]).to(acc.dtype)
        rows.append(acc)
    return torch.cat(rows)
