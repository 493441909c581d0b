"""PLE kernels (ops/triton/ple.py, in Triton's interpreter without a GPU) against their torch references
(ops/ple.py): the decode step's table rows and context update bit for bit (eos resets, contexts at a
sequence's start, int64 hashes that wrap around and go negative), the gate within rounding and
row-invariant (C1); and the CPU path is the torch code the model ran before."""

import math

import pytest
import torch
from triton_interp import DEV, needs_cuda, small

from nextserve.model.ple import head_vocab_sizes, multipliers
from nextserve.ops.ple import ngram_contexts, ngram_ids, ple_decode_ids, ple_gate
from nextserve.ops.triton.ple import triton_ple_decode_ids, triton_ple_gate

gpu = pytest.mark.gpu
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- ids -------------------------------------------------------------------------------------------
def _tables(N: int, per_order: int, vocab: int, ple_index: int = 1, base: int = 101):
    """(mult [N], sizes, offsets [(N-1)*per_order]) int64, as NGramEmbedding builds them."""
    sizes = head_vocab_sizes(base, ple_index, (N - 1) * per_order)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    mult = multipliers(vocab, N, ple_index, seed=1234)
    return tuple(torch.tensor(v, dtype=torch.long) for v in (mult, sizes, offsets))


def _plane(S: int, N: int, hi: int, eos: int, seed: int) -> torch.Tensor:
    """[S, N-1] contexts: random ids below `hi` with eos sprinkled in; slot 0 all eos (a sequence start),
    slot 1 eos at its newest position, slot 2 eos at its oldest."""
    g = _gen(seed)
    plane = torch.randint(0, hi, (S, N - 1), generator=g)
    plane[torch.rand(S, N - 1, generator=g) < 0.2] = eos
    plane[0] = eos
    plane[1, -1] = eos
    plane[2, 0] = eos
    return plane


def _slots(S: int, B: int, g: torch.Generator) -> torch.Tensor:
    """B distinct slots of S, out of order, slots 0-2 (the special contexts of `_plane`) among them."""
    # NOTE: decode rows have distinct slots (padding rows share the scratch slot, whose result is unused):
    # with a repeated slot the update order between rows is unspecified, in torch and in the kernel.
    rest = 3 + torch.randperm(S - 3, generator=g)[: B - 3]
    return torch.cat([torch.tensor([2, 0, 1]), rest])[torch.randperm(B, generator=g)]


def _reference(plane, slots, tok, mult, sizes, offsets, eos, per_order):
    """The former PLE.decode code, verbatim (on a copy of the plane)."""
    plane = plane.clone()
    N = plane.shape[1] + 1
    hist = torch.cat([plane.index_select(0, slots), tok[:, None]], dim=1)  # [B, N]
    ids = ngram_ids(ngram_contexts(hist, 1, N, eos)[:, 0], mult, sizes, offsets, per_order)
    plane.index_copy_(0, slots, hist[:, 1:])
    return ids, plane


def _hashes(plane, slots, tok, mult, eos) -> torch.Tensor:
    """The full-order hash of each row (to check a case really wraps around)."""
    c = ngram_contexts(torch.cat([plane[slots], tok[:, None]], dim=1), 1, plane.shape[1] + 1, eos)[:, 0]
    h = c[:, 0] * mult[0]
    for k in range(1, c.shape[1]):
        h = h ^ (c[:, k] * mult[k])
    return h


def _check_ids(N: int, per_order: int, vocab: int, hi: int, eos: int, seed: int, device: str = DEV):
    S, B = 12, 9
    mult, sizes, offsets = _tables(N, per_order, vocab)
    plane = _plane(S, N, hi, eos, seed)
    g = _gen(seed + 1)
    slots = _slots(S, B, g)
    tok = torch.randint(0, hi, (B,), generator=g)
    tok[1] = eos  # an eos as the new token: it is c_0 and blocks nothing
    ref_ids, ref_plane = _reference(plane, slots, tok, mult, sizes, offsets, eos, per_order)
    got_plane = plane.clone().to(device)
    dev = [t.to(device) for t in (slots, tok, mult, sizes, offsets)]
    got_ids = triton_ple_decode_ids(got_plane, *dev[:2], *dev[2:], eos, per_order)
    assert got_ids.dtype == torch.long and got_ids.shape == (B, (N - 1) * per_order)
    assert torch.equal(got_ids.cpu(), ref_ids)
    assert torch.equal(got_plane.cpu(), ref_plane)
    assert (ref_ids >= offsets).all() and (ref_ids < offsets + sizes).all()
    return _hashes(plane, slots, tok, mult, eos)


@small
@pytest.mark.parametrize("N", [2, 3, 4])
@pytest.mark.parametrize("eos", [1, 7])
def test_decode_ids_real_multipliers(N: int, eos: int) -> None:
    """Ids below the vocab with its multipliers: the real case (hashes stay non-negative)."""
    _check_ids(N, per_order=3, vocab=512, hi=512, eos=eos, seed=N)


@small
@pytest.mark.parametrize("N", [2, 3, 4])
def test_decode_ids_wrapping_hashes(N: int) -> None:
    """Multipliers made for a vocab of 2 (~2^62) on ids up to 10^6: products wrap around and hashes go
    negative; torch.remainder's floor remainder must come out (never negative)."""
    h = _check_ids(N, per_order=2, vocab=2, hi=10**6, eos=5, seed=10 + N)
    assert (h < 0).any() and (h > 0).any(), h


@small
def test_decode_ids_strided_plane() -> None:
    """A plane that is one layer of a stacked [layers, S, N-1] tensor, as SlotStates holds it."""
    N, per_order, eos = 3, 2, 1
    mult, sizes, offsets = _tables(N, per_order, vocab=2)
    planes = torch.stack([_plane(6, N, 10**6, eos, seed) for seed in (20, 21)])
    slots, tok = torch.tensor([4, 0, 3]), torch.tensor([eos, 999_999, 17])
    ref_ids, ref_plane = _reference(planes[1], slots, tok, mult, sizes, offsets, eos, per_order)
    before, planes = planes[0].clone(), planes.to(DEV)
    dev = [t.to(DEV) for t in (slots, tok, mult, sizes, offsets)]
    got = triton_ple_decode_ids(planes[1], *dev, eos, per_order).cpu()
    planes = planes.cpu()
    assert torch.equal(got, ref_ids) and torch.equal(planes[1], ref_plane) and torch.equal(planes[0], before)


def test_decode_ids_cpu_path_is_the_former_code() -> None:
    N, per_order, eos = 3, 2, 1
    mult, sizes, offsets = _tables(N, per_order, vocab=2)
    plane = _plane(8, N, 10**6, eos, seed=30)
    slots, tok = torch.tensor([5, 0, 2, 7]), torch.tensor([3, eos, 10**5, 8])
    ref_ids, ref_plane = _reference(plane, slots, tok, mult, sizes, offsets, eos, per_order)
    ids = ple_decode_ids(plane, slots, tok, mult, sizes, offsets, eos, per_order)
    assert torch.equal(ids, ref_ids) and torch.equal(plane, ref_plane)


# ---- gate ------------------------------------------------------------------------------------------
def _former_gate(key, query, value, n, H, ri):
    """PLE._gated after the norms, before ple_gate (verbatim)."""
    from nextserve.ops.pointwise import rowwise

    T = key.shape[0]
    d = (key.view(T, n, H) * query.view(T, n, H)).sum(dim=-1, keepdim=True) / math.sqrt(H)
    gate = d.abs().clamp_min(1e-6).sqrt() * d.sign()
    return (rowwise(torch.sigmoid, gate, ri) * value.unsqueeze(-2)).flatten(-2)


def _gate_inputs(T: int, n: int, H: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    """key, query [T, n*H] (norm-sized), value [T, H] a column slice of a stacked key|value projection;
    row 0 stream 0 has d == 0 and row 1 stream 1 a |d| under the 1e-6 clamp."""
    g = _gen(seed)
    key = torch.randn(T, n * H, generator=g)
    query = torch.randn(T, n * H, generator=g)
    key[0, :H] = 0.0
    key[1, H : 2 * H] = 0.0
    key[1, H], query[1, H] = 1e-3, 1e-3 * math.sqrt(H) / 4  # d = 2.5e-7
    kv = torch.randn(T, n * H + H, generator=g) * 2
    to = lambda t: t.to(dtype).to(device)  # noqa: E731
    return to(key), to(query), to(kv)[:, n * H :]


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape, (got.dtype, ref.dtype, got.shape, ref.shape)
    torch.testing.assert_close(got.float().cpu(), ref.float().cpu(), rtol=tol, atol=tol)


def _rows_invariant(fn, *ts: torch.Tensor) -> None:
    full = fn(*ts)
    for i in range(ts[0].shape[0]):
        assert torch.equal(fn(*(t[i : i + 1] for t in ts))[0], full[i]), f"row {i} alone"
    assert torch.equal(fn(*(t[1:4].clone() for t in ts)), full[1:4]), "rows 1:4"


@small
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("H", [48, 1100])  # one block; two blocks, the second masked
def test_gate(dtype: torch.dtype, H: int) -> None:
    n, T = 4, 6
    key, query, value = _gate_inputs(T, n, H, dtype, seed=H, device=DEV)
    got = triton_ple_gate(key, query, value, n, H)
    ref = _former_gate(key.cpu(), query.cpu(), value.cpu(), n, H, True)
    _close(got, ref, TOL[dtype])
    assert torch.equal(got[0, :H], (value[0] * 0.5).to(dtype)), "d == 0: sigmoid(0) * value"
    _rows_invariant(lambda k, q, v: triton_ple_gate(k, q, v, n, H), key, query, value)


@pytest.mark.parametrize("ri", [False, True])
def test_gate_cpu_path_is_the_former_code(ri: bool) -> None:
    n, H = 4, 48
    key, query, value = _gate_inputs(5, n, H, torch.bfloat16, seed=40)
    assert torch.equal(ple_gate(key, query, value, n, H, ri), _former_gate(key, query, value, n, H, ri))


# ---- CUDA: real sizes, graph capture ----------------------------------------------------------------
@gpu
@needs_cuda
def test_cuda_decode_ids() -> None:
    """Flash-Next's PLE: N = 3, 16 heads (8 per order), its vocab, multipliers and primes; and wrapping
    hashes; through the op's dispatch, against the CPU reference bit for bit."""
    N, per_order, S, B, eos = 3, 8, 64, 40, 248044
    for vocab, hi in ((248320, 248320), (2, 10**9)):
        mult, sizes, offsets = _tables(N, per_order, vocab, ple_index=0, base=200000)
        plane = _plane(S, N, hi, eos, seed=50)
        g = _gen(51)
        slots = _slots(S, B, g)
        tok = torch.randint(0, hi, (B,), generator=g)
        tok[5] = eos
        ref_ids, ref_plane = _reference(plane, slots, tok, mult, sizes, offsets, eos, per_order)
        got_plane = plane.cuda()
        dev = [t.cuda() for t in (slots, tok, mult, sizes, offsets)]
        got = ple_decode_ids(got_plane, *dev, eos, per_order)
        torch.cuda.synchronize()
        assert got.is_cuda and torch.equal(got.cpu(), ref_ids), vocab
        assert torch.equal(got_plane.cpu(), ref_plane), vocab


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_gate(dtype: torch.dtype) -> None:
    """n = 4, H = 2560 on CUDA against the CPU reference, row-invariant, and the same in a CUDA graph."""
    n, H, T = 4, 2560, 33
    key, query, value = _gate_inputs(T, n, H, dtype, seed=60, device="cuda")
    got = ple_gate(key, query, value, n, H, True)
    ref = ple_gate(key.cpu(), query.cpu(), value.cpu(), n, H, True)
    _close(got, ref, TOL[dtype])
    _rows_invariant(lambda k, q, v: ple_gate(k, q, v, n, H, True), key, query, value)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ple_gate(key, query, value, n, H, True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


@gpu
@needs_cuda
def test_cuda_decode_ids_graph() -> None:
    """The ids kernel captured in a CUDA graph: each replay hashes and advances the slots' contexts."""
    N, per_order, eos = 3, 8, 248044
    mult, sizes, offsets = (t.cuda() for t in _tables(N, per_order, 248320, ple_index=0, base=200000))
    plane = _plane(16, N, 248320, eos, seed=70).cuda()
    slots, tok = torch.tensor([3, 0, 9, 1]).cuda(), torch.zeros(4, dtype=torch.long).cuda()
    ref_plane = plane.cpu()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ple_decode_ids(plane, slots, tok, mult, sizes, offsets, eos, per_order)
    plane.copy_(ref_plane.cuda())  # capture ran nothing, but be sure the plane is the start state
    for step in range(3):
        new = torch.tensor([step * 1000 + 7, eos, 5 + step, 248319])
        tok.copy_(new.cuda())
        graph.replay()
        ref_ids, ref_plane = _reference(
            ref_plane, slots.cpu(), new, mult.cpu(), sizes.cpu(), offsets.cpu(), eos, per_order
        )
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), ref_ids) and torch.equal(plane.cpu(), ref_plane), step
