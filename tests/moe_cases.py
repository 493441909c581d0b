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
