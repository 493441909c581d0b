"""Batched decode-step ops (conv_step, recurrent_step): the CPU references are the per-row serial decode
bit for bit; the Triton kernels (in the interpreter without a GPU) match them and are row-invariant."""

import pytest
import torch

from nextserve.ops.conv import causal_conv, conv_step
from nextserve.ops.gdn import gated_delta_rule, recurrent_step
from nextserve.ops.triton.conv_step import triton_conv_step
from nextserve.ops.triton.gdn_step import triton_recurrent_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SLOTS = [5, 0, 3, 6, 2]  # distinct, unordered; slots 1, 4 and 7 of the plane stay untouched
NUM_SLOTS = 8
CONV_SHAPES = [(1, 40), (3, 40), (1, 300)]  # (dilation, C): PLE uses dilation 3; 300 spans two tiles
GDN_SHAPES = [(2, 6, 16, 16), (1, 2, 24, 40)]  # (Hk, Hv, dk, dv); the second has masked, split tiles
K = 4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _conv_inputs(dilation: int, C: int, B: int, dtype: torch.dtype, seed: int = 0):
    g = _gen(seed + C + dilation)
    x = torch.randn(B, C, generator=g).to(dtype)
    state = torch.randn(NUM_SLOTS, C, (K - 1) * dilation, generator=g).to(dtype)
    weight = (torch.randn(C, K, generator=g) / K**0.5).to(dtype)
    return x, state, weight


def _gdn_inputs(shape, B: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v as views into one [B, conv_dim] row, as the model slices them."""
    Hk, Hv, dk, dv = shape
    g = _gen(seed + Hv + dv)
    kd = Hk * dk
    x = torch.randn(B, 2 * kd + Hv * dv, generator=g).to(dtype)
    q = x[:, :kd].view(B, Hk, dk)
    k = x[:, kd : 2 * kd].view(B, Hk, dk)
    v = x[:, 2 * kd :].view(B, Hv, dv)
    gate = -torch.rand(B, Hv, generator=g) * 2  # float32, as the model computes it
    beta = torch.rand(B, Hv, generator=g).to(dtype)
    state = torch.randn(NUM_SLOTS, Hv, dk, dv, generator=g) * 0.5
    return q, k, v, gate, beta, state


def _to(device, *ts):
    return [t.to(device) for t in ts]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---- the CPU references are the serial decode step, bit for bit ---------------------------------
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dilation", [1, 3])
def test_conv_step_reference_is_per_row_causal_conv(dilation: int, dtype: torch.dtype, silu: bool) -> None:
    x, state, weight = _conv_inputs(dilation, 40, len(SLOTS), dtype)
    expect_state = state.clone()
    expect = []
    for b, s in enumerate(SLOTS):
        out, new_hist = causal_conv(x[b : b + 1], expect_state[s], weight, dilation)
        expect_state[s].copy_(new_hist)
        expect.append((torch.nn.functional.silu(out) if silu else out)[0])
    got = conv_step(x, state, torch.tensor(SLOTS), weight, dilation, silu)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, torch.stack(expect))
    assert torch.equal(state, expect_state)  # the slots' histories, and every other slot untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_step_reference_is_per_row_gated_delta_rule(dtype: torch.dtype) -> None:
    q, k, v, gate, beta, state = _gdn_inputs(GDN_SHAPES[0], len(SLOTS), dtype)
    before = state.clone()
    expect_state = state.clone()
    expect = []
    for b, s in enumerate(SLOTS):
        o, new = gated_delta_rule(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], gate[b : b + 1], beta[b : b + 1], expect_state[s]
        )
        expect_state[s].copy_(new)
        expect.append(o[0])
    got = recurrent_step(q, k, v, gate, beta, state, torch.tensor(SLOTS))
    assert got.dtype == dtype and got.shape == v.shape
    assert torch.equal(got, torch.stack(expect))
    assert torch.equal(state, expect_state)
    untouched = [i for i in range(NUM_SLOTS) if i not in SLOTS]
    assert torch.equal(state[untouched], before[untouched])


# ---- the kernels against the references -----------------------------------------------------------
def _check_conv_kernel(dilation: int, C: int, dtype: torch.dtype, silu: bool, tol: float) -> None:
    x, state, weight = _conv_inputs(dilation, C, len(SLOTS), dtype)
    slots = torch.tensor(SLOTS)
    ref_state = state.clone()
    ref = conv_step(x, ref_state, slots, weight, dilation, silu)
    x, state, weight, slots = _to(DEVICE, x, state, weight, slots)
    got = triton_conv_step(x, state, slots, weight, dilation, silu)
    assert got.dtype == dtype and got.shape == ref.shape
    assert _rel(got, ref) < tol
    # the new histories are copies of inputs (no arithmetic): exact in every dtype
    assert torch.equal(state.cpu(), ref_state)


def _check_gdn_kernel(shape, dtype: torch.dtype, tol: float) -> None:
    q, k, v, gate, beta, state = _gdn_inputs(shape, len(SLOTS), dtype)
    slots = torch.tensor(SLOTS)
    ref_state = state.clone()
    ref = recurrent_step(q, k, v, gate, beta, ref_state, slots)
    dev = _to(DEVICE, q, k, v, gate, beta, state, slots)
    got = triton_recurrent_step(*dev)
    state = dev[5].cpu()
    assert got.dtype == dtype and got.shape == ref.shape
    assert _rel(got, ref) < tol
    assert _rel(state[SLOTS], ref_state[SLOTS]) < tol
    untouched = [i for i in range(NUM_SLOTS) if i not in SLOTS]
    assert torch.equal(state[untouched], ref_state[untouched])


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize(("dilation", "C"), CONV_SHAPES)
def test_conv_kernel_matches_reference(dilation: int, C: int, silu: bool) -> None:
    _check_conv_kernel(dilation, C, torch.float32, silu, 1e-6)


@pytest.mark.parametrize("shape", GDN_SHAPES)
def test_gdn_kernel_matches_reference(shape) -> None:
    _check_gdn_kernel(shape, torch.float32, 1e-5)


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("dilation", [1, 3])
def test_conv_kernel_float16(dilation: int, silu: bool) -> None:
    # the reference rounds every tap to float16, the kernel accumulates in float32
    _check_conv_kernel(dilation, 300, torch.float16, silu, 2e-3)


def test_gdn_kernel_float16() -> None:
    _check_gdn_kernel(GDN_SHAPES[1], torch.float16, 2e-3)


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("dilation", [1, 3])
@pytest.mark.gpu
@needs_cuda
def test_conv_kernel_bfloat16(dilation: int, silu: bool) -> None:
    _check_conv_kernel(dilation, 300, torch.bfloat16, silu, 1e-2)


@pytest.mark.parametrize("shape", GDN_SHAPES)
@pytest.mark.gpu
@needs_cuda
def test_gdn_kernel_bfloat16(shape) -> None:
    _check_gdn_kernel(shape, torch.bfloat16, 1e-2)


# ---- row invariance of the kernels (C1) -----------------------------------------------------------
def _subsets(B: int) -> list[list[int]]:
    """Each row alone, sub-batches, and the whole batch reversed."""
    return [[i] for i in range(B)] + [[0, 1], [2, 3, 4], [4, 1, 3], list(range(B))[::-1]]


def _check_rows(step, row_inputs, state: torch.Tensor) -> None:
    """step(rows, state, slots) -> out; every subset of rows gives each row the bits of the full call."""
    slots = torch.tensor(SLOTS, device=DEVICE)
    full_state = state.clone()
    full = step(row_inputs, full_state, slots)
    for rows in _subsets(len(SLOTS)):
        idx = torch.tensor(rows, device=DEVICE)
        sub_state = state.clone()
        sub = step([t[idx] for t in row_inputs], sub_state, slots[idx])
        assert torch.equal(sub, full[idx]), rows
        touched = slots[idx]
        assert torch.equal(sub_state[touched], full_state[touched]), rows


@pytest.mark.parametrize("dilation", [1, 3])
def test_conv_kernel_rows_are_invariant(dilation: int) -> None:
    x, state, weight = _to(DEVICE, *_conv_inputs(dilation, 300, len(SLOTS), torch.float32))
    _check_rows(lambda r, st, sl: triton_conv_step(r[0], st, sl, weight, dilation, True), [x], state)


@pytest.mark.parametrize("shape", GDN_SHAPES)
def test_gdn_kernel_rows_are_invariant(shape) -> None:
    q, k, v, gate, beta, state = _to(DEVICE, *_gdn_inputs(shape, len(SLOTS), torch.float32))
    _check_rows(lambda r, st, sl: triton_recurrent_step(*r, st, sl), [q, k, v, gate, beta], state)


# ---- several steps with the state carried ---------------------------------------------------------
def test_steps_carry_state_close_to_reference() -> None:
    """conv (dilation 1, SiLU) then the recurrence for 6 decode steps, kernels vs references."""
    Hk, Hv, dk, dv = GDN_SHAPES[0]
    C = 2 * Hk * dk + Hv * dv
    slots = torch.tensor(SLOTS)
    _, conv_state, weight = _conv_inputs(1, C, len(SLOTS), torch.float32, seed=1)
    *_, rec_state = _gdn_inputs(GDN_SHAPES[0], len(SLOTS), torch.float32, seed=1)
    ref_conv, ref_rec = conv_state.clone(), rec_state.clone()
    conv_state, rec_state, weight, dslots = _to(DEVICE, conv_state, rec_state, weight, slots)
    g = _gen(2)
    kd = Hk * dk
    for _ in range(6):
        x = torch.randn(len(SLOTS), C, generator=g)
        gate = -torch.rand(len(SLOTS), Hv, generator=g) * 2
        beta = torch.rand(len(SLOTS), Hv, generator=g)
        ref_x = conv_step(x, ref_conv, slots, weight.cpu(), 1, True)
        ref_qkv = ref_x[:, :kd], ref_x[:, kd : 2 * kd], ref_x[:, 2 * kd :]
        B = len(SLOTS)
        ref = recurrent_step(
            ref_qkv[0].view(B, Hk, dk), ref_qkv[1].view(B, Hk, dk), ref_qkv[2].view(B, Hv, dv),
            gate, beta, ref_rec, slots,
        )  # fmt: skip
        dx = triton_conv_step(x.to(DEVICE), conv_state, dslots, weight, 1, True)
        got = triton_recurrent_step(
            dx[:, :kd].view(B, Hk, dk), dx[:, kd : 2 * kd].view(B, Hk, dk), dx[:, 2 * kd :].view(B, Hv, dv),
            gate.to(DEVICE), beta.to(DEVICE), rec_state, dslots,
        )  # fmt: skip
        assert _rel(dx, ref_x) < 1e-6
        assert _rel(got, ref) < 1e-5
        assert _rel(rec_state.cpu(), ref_rec) < 1e-5
    assert torch.equal(conv_state.cpu(), ref_conv)


# ---- CUDA only: the public functions dispatch to the kernels, and the step captures in a graph ----
@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_capture() -> None:
    Hk, Hv, dk, dv = GDN_SHAPES[0]
    C, B, kd = 2 * Hk * dk + Hv * dv, len(SLOTS), Hk * dk
    _, conv_state, weight = _to("cuda", *_conv_inputs(1, C, B, torch.float32))
    *_, rec_state = _gdn_inputs(GDN_SHAPES[0], B, torch.float32)
    rec_state = rec_state.cuda()
    x = torch.zeros(B, C, device="cuda")
    gate = torch.zeros(B, Hv, device="cuda")
    beta = torch.zeros(B, Hv, device="cuda")
    slots = torch.tensor(SLOTS, device="cuda")

    def step():
        h = conv_step(x, conv_state, slots, weight, 1, True)
        q, k, v = h[:, :kd].view(B, Hk, dk), h[:, kd : 2 * kd].view(B, Hk, dk), h[:, 2 * kd :].view(B, Hv, dv)
        return recurrent_step(q, k, v, gate, beta, rec_state, slots)

    eager_conv, eager_rec = conv_state.clone(), rec_state.clone()
    step()  # compile outside the capture
    conv_state.copy_(eager_conv)
    rec_state.copy_(eager_rec)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    conv_state.copy_(eager_conv)
    rec_state.copy_(eager_rec)
    g = torch.Generator(device="cuda").manual_seed(3)
    inputs = [(torch.randn(B, C, device="cuda", generator=g), torch.rand(B, Hv, device="cuda", generator=g))
              for _ in range(3)]  # fmt: skip
    graphed = []
    for xi, bi in inputs:
        x.copy_(xi), gate.copy_(-bi), beta.copy_(bi)
        graph.replay()
        graphed.append(out.clone())
    conv_state_g, rec_state_g = conv_state.clone(), rec_state.clone()
    conv_state.copy_(eager_conv)
    rec_state.copy_(eager_rec)
    for (xi, bi), o in zip(inputs, graphed, strict=True):
        x.copy_(xi), gate.copy_(-bi), beta.copy_(bi)
        assert torch.equal(step(), o)
    assert torch.equal(conv_state, conv_state_g) and torch.equal(rec_state, rec_state_g)
