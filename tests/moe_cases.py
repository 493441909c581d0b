"""Random routed-experts problems for the MoE kernel tests (tests/ops/test_moe_*.py)."""

import torch
from triton_interp import DEV


def moe_problem(M, H, E, k, I, dtype, seed, device=DEV, experts_used=None):
    """x [M, H], w [M, k], ids [M, k], gate_up [E, 2I, H], down [E, H, I]: random routing of M rows to
    k distinct experts each, drawn from `experts_used` (default all)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g)
    gate_up = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    down = torch.randn(E, H, I, generator=g) / I**0.5
    pool = torch.arange(E) if experts_used is None else torch.tensor(experts_used)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(M)])
    w = torch.rand(M, k, generator=g)
    w = w / w.sum(-1, keepdim=True)
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return cast(x), cast(w), ids.to(device), cast(gate_up), cast(down)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_quantized_experts(experts, E: int, k: int, dtype: torch.dtype, close, tol: float, **kw) -> None:
    """The grouped expert kernels on quantized weights `experts` = (gate_up [E, 2I, H], down [E, H, I], and
    the shared expert's pair; each with `.dequantize(dtype)`): decode with the shared expert, prefill, and
    the wide prefill blocks each `close(got, twin)` to the same kernels on the dequantized weights; decode
    rows invariant (torch.equal) at 1 and 5 rows; decode within 4 * tol of float64 on the dequantized
    weights. `kw`: more arguments of the kernels on the quantized weights (int4_slabs)."""
    from nextserve.ops.moe import _experts_by_row, route
    from nextserve.ops.triton.moe_grouped import grouped_decode_experts, grouped_experts

    gu, dn, sgu, sdn = experts
    H = gu.shape[-1]
    g = torch.Generator().manual_seed(9)
    x = torch.randn(12, H, generator=g).to(device=DEV, dtype=dtype)
    logits = torch.randn(12, E + 1, generator=g).to(device=DEV, dtype=dtype)
    w, ids = route(logits, k, True, shared=True)
    deq = [t.dequantize(dtype) for t in experts]
    got = grouped_decode_experts(x, w, ids, gu, dn, shared=(sgu, sdn), **kw)
    close(got, grouped_decode_experts(x, w, ids, deq[0], deq[1], shared=(deq[2], deq[3])))
    for m in (1, 5):  # one row runs the deep pipeline, 5 and 12 rows STAGES: the same bits
        part = grouped_decode_experts(
            x[:m].clone(), w[:m].clone(), ids[:m].clone(), gu, dn, shared=(sgu, sdn), **kw
        )
        assert torch.equal(part, got[:m]), m
    f64 = [t.dequantize(torch.float64) for t in experts]
    ref = _experts_by_row(x.double(), w.double(), ids, f64[0], f64[1], (f64[2], f64[3]))
    assert rel_err(got, ref) < tol * 4
    w2, ids2 = route(logits[:, :E], k, True)
    close(grouped_experts(x, w2, ids2, gu, dn, **kw), grouped_experts(x, w2, ids2, deq[0], deq[1]))
    # 8 warps, the shared expert
    wide = grouped_experts(x, w, ids, gu, dn, block_m=128, shared=(sgu, sdn), **kw)
    close(wide, grouped_experts(x, w, ids, deq[0], deq[1], block_m=128, shared=(deq[2], deq[3])))
