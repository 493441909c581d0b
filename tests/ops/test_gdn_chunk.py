"""The prefill GDN kernel (triton_gated_delta_rule, one launch per chunk): matches the token-by-token
reference `gated_delta_rule`, carries the state across chunks, and gives a token the same bits as T
successive one-token decode steps (triton_recurrent_step, B = 1). Without a GPU the kernels run in
Triton's interpreter (float32/float16 only there: bfloat16 is broken in the interpreter)."""

import pytest
import torch

from nextserve.ops.gdn import (
    FLA_MIN_TOKENS,
    _fla_chunk,
    fla_gated_delta_rule,
    gated_delta_rule,
    gated_delta_rule_reference,
)
from nextserve.ops.triton.gdn_chunk import triton_gated_delta_rule
from nextserve.ops.triton.gdn_step import triton_recurrent_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GDN_SHAPES = [(2, 6, 16, 16), (1, 2, 24, 40)]  # (Hk, Hv, dk, dv); the second has masked, split tiles
REAL_SHAPE = (16, 48, 128, 128)
TS = [1, 7, 20]


def _inputs(shape, T: int, dtype: torch.dtype, seed: int = 0, decay: float = 2.0):
    """q, k, v as views into one [T, conv_dim] activation (strided rows), as the model slices them."""
    Hk, Hv, dk, dv = shape
    gen = torch.Generator().manual_seed(seed + 1000 * T + Hv + dv)
    kd = Hk * dk
    x = torch.randn(T, 2 * kd + Hv * dv, generator=gen).to(dtype)
    q = x[:, :kd].view(T, Hk, dk)
    k = x[:, kd : 2 * kd].view(T, Hk, dk)
    v = x[:, 2 * kd :].view(T, Hv, dv)
    gate = -torch.rand(T, Hv, generator=gen) * decay  # float32, as the model computes it
    beta = torch.rand(T, Hv, generator=gen).to(dtype)
    state = torch.randn(Hv, dk, dv, generator=gen) * 0.5
    return q, k, v, gate, beta, state


def _to(device, *ts):
    return [t.to(device) for t in ts]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _decode_steps(q, k, v, gate, beta, state):
    """T successive one-token decode steps (B = 1, slot 0) of the decode kernel."""
    plane = state.clone().unsqueeze(0)
    slots = torch.zeros(1, dtype=torch.int64, device=state.device)
    outs = []
    for t in range(v.shape[0]):
        sl = slice(t, t + 1)
        outs.append(triton_recurrent_step(q[sl], k[sl], v[sl], gate[sl], beta[sl], plane, slots))
    return torch.cat(outs), plane[0]


def _check_vs_reference(shape, T: int, dtype: torch.dtype, tol: float, device: str = DEVICE, **kw) -> None:
    dev = _to(device, *_inputs(shape, T, dtype, **kw))
    ref_o, ref_s = gated_delta_rule_reference(*dev)  # the torch loop, on the same device
    before = dev[5].clone()
    o, s = triton_gated_delta_rule(*dev)
    assert o.dtype == dtype and o.shape == dev[2].shape
    assert s.dtype == torch.float32 and s.shape == dev[5].shape
    assert _rel(o, ref_o) < tol, _rel(o, ref_o)
    assert _rel(s, ref_s) < tol, _rel(s, ref_s)
    assert torch.equal(dev[5], before)  # the input state is only read


def test_cpu_path_is_the_reference() -> None:
    q, k, v, gate, beta, state = _inputs(GDN_SHAPES[0], 5, torch.float32)
    o, s = gated_delta_rule(q, k, v, gate, beta, state)
    ref_o, ref_s = gated_delta_rule_reference(q, k, v, gate, beta, state)
    assert torch.equal(o, ref_o) and torch.equal(s, ref_s)


# ---- against the reference (interpreter on CPU, or the GPU) ---------------------------------------
@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("shape", GDN_SHAPES)
def test_chunk_kernel_matches_reference(shape, T: int) -> None:
    _check_vs_reference(shape, T, torch.float32, 1e-5)


@pytest.mark.parametrize("T", [1, 20])
def test_chunk_kernel_float16(T: int) -> None:
    _check_vs_reference(GDN_SHAPES[1], T, torch.float16, 2e-3)


def test_chunk_kernel_empty_chunk() -> None:
    q, k, v, gate, beta, state = _to(DEVICE, *_inputs(GDN_SHAPES[0], 0, torch.float32))
    o, s = triton_gated_delta_rule(q, k, v, gate, beta, state)
    assert o.shape == v.shape and torch.equal(s, state) and s.data_ptr() != state.data_ptr()


@pytest.mark.parametrize("shape", GDN_SHAPES)
def test_state_carried_across_chunks(shape) -> None:
    """Chunk A then chunk B from A's state = one chunk of A + B (close; bits in test_*_bits below)."""
    q, k, v, gate, beta, state = _to(DEVICE, *_inputs(shape, 20, torch.float32))
    whole_o, whole_s = triton_gated_delta_rule(q, k, v, gate, beta, state)
    a_o, a_s = triton_gated_delta_rule(q[:8], k[:8], v[:8], gate[:8], beta[:8], state)
    b_o, b_s = triton_gated_delta_rule(q[8:], k[8:], v[8:], gate[8:], beta[8:], a_s)
    assert _rel(torch.cat([a_o, b_o]), whole_o) < 1e-6
    assert _rel(b_s, whole_s) < 1e-6


# ---- bit equality: prefill chunk == chunks split anywhere == successive decode steps --------------
def _check_bits(shape, T: int, dtype: torch.dtype, splits, **kw) -> None:
    q, k, v, gate, beta, state = _to(DEVICE, *_inputs(shape, T, dtype, **kw))
    o, s = triton_gated_delta_rule(q, k, v, gate, beta, state)
    dec_o, dec_s = _decode_steps(q, k, v, gate, beta, state)
    assert torch.equal(o, dec_o)
    assert torch.equal(s, dec_s)
    bounds = [0, *splits, T]
    outs, st = [], state
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        part, st = triton_gated_delta_rule(q[a:b], k[a:b], v[a:b], gate[a:b], beta[a:b], st)
        outs.append(part)
    assert torch.equal(torch.cat(outs), o)
    assert torch.equal(st, s)


@pytest.mark.parametrize("shape", GDN_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunk_bits_equal_decode_steps(shape, dtype: torch.dtype) -> None:
    _check_bits(shape, 12, dtype, [1, 5])


# ---- GPU only: bfloat16 at the real sizes, T = 1024 ------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", GDN_SHAPES)
def test_chunk_kernel_bfloat16_small(shape) -> None:
    _check_vs_reference(shape, 64, torch.bfloat16, 1e-2)


@pytest.mark.gpu
@needs_cuda
def test_chunk_kernel_bfloat16_real_sizes() -> None:
    # the reference (torch float32 loop) and the kernel read the same bf16 inputs; the output is rounded
    # to bf16, the state stays float32. Slow decay so the state keeps a long memory.
    _check_vs_reference(REAL_SHAPE, 1024, torch.bfloat16, 1e-2, device="cuda", decay=0.2)


@pytest.mark.gpu
@needs_cuda
def test_chunk_bits_equal_decode_steps_real_sizes() -> None:
    _check_bits(REAL_SHAPE, 1024, torch.bfloat16, [1, 300, 301, 1000], decay=0.2)


@pytest.mark.gpu
@needs_cuda
def test_gated_delta_rule_dispatches_to_kernel() -> None:
    """Below FLA_MIN_TOKENS (and in float32) the token-by-token kernel; from it on, in 16-bit, fla's."""
    for T, dtype, kernel in [
        (FLA_MIN_TOKENS - 1, torch.bfloat16, triton_gated_delta_rule),
        (FLA_MIN_TOKENS, torch.float32, triton_gated_delta_rule),
        (FLA_MIN_TOKENS, torch.bfloat16, fla_gated_delta_rule),
    ]:
        q, k, v, gate, beta, state = _to("cuda", *_inputs(REAL_SHAPE, T, dtype))
        o, s = gated_delta_rule(q, k, v, gate, beta, state)
        ko, ks = kernel(q, k, v, gate, beta, state)
        assert torch.equal(o, ko) and torch.equal(s, ks), (T, dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [64, 333, 2048])
def test_fla_chunk_matches_the_reference(T: int) -> None:
    """fla's chunked algorithm (16-bit prefill chunks) against the float32 token-by-token loop at the real
    widths: close, deterministic, the input state only read, and the state carried across two chunks as
    one chunk carries it."""
    assert _fla_chunk() is not None, "flash-linear-attention (fla-core, the gpu extra) is not installed"
    q, k, v, gate, beta, state = _to("cuda", *_inputs(REAL_SHAPE, T, torch.bfloat16, decay=0.2))
    before = state.clone()
    o, s = fla_gated_delta_rule(q, k, v, gate, beta, state)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32 and torch.equal(state, before)
    ref_o, ref_s = gated_delta_rule_reference(q.float(), k.float(), v.float(), gate, beta.float(), state)
    assert _rel(o, ref_o) < 2e-2 and _rel(s, ref_s) < 2e-2, (_rel(o, ref_o), _rel(s, ref_s))
    o2, s2 = fla_gated_delta_rule(q, k, v, gate, beta, state)
    assert torch.equal(o, o2) and torch.equal(s, s2)
    h = T // 2
    o_a, s_a = fla_gated_delta_rule(q[:h], k[:h], v[:h], gate[:h], beta[:h], state)
    o_b, s_b = fla_gated_delta_rule(q[h:], k[h:], v[h:], gate[h:], beta[h:], s_a)
    assert _rel(torch.cat([o_a, o_b]), ref_o) < 2e-2 and _rel(s_b, ref_s) < 2e-2
