"""The rotary kernel (ops/triton/rope.py, in Triton's interpreter without a GPU) against apply_rope's
torch reference, on strided views as the model passes them (q inside the q|gate projection, cos/sin
split from one tensor), and row invariance (C1)."""

import pytest
import torch

from nextserve.ops import rope as rope_ops
from nextserve.ops.rope import cos_sin, inv_freq
from nextserve.ops.triton.rope import triton_apply_rope

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}


def _reference(x, cos, sin):
    """apply_rope's torch code (what the CPU path runs)."""
    rot = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * c + rope_ops._rotate_half(x_rot) * s, x_pass], dim=-1)


def _inputs(T: int, heads: int, D: int, rot: int, dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(T * 31 + D)
    qg = (torch.randn(T, heads, 2 * D, generator=g) * 2).to(dtype).to(device)
    x = qg[..., :D]  # a strided view, as q inside q|gate
    pos = torch.randint(0, 5000, (T,), generator=g).to(device)
    cs = torch.cat(cos_sin(pos, inv_freq(rot, 1e7).to(device), dtype), dim=-1)
    cos, sin = cs.chunk(2, dim=-1)
    return x, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 3, 32, 16), (4, 2, 256, 64), (3, 1, 128, 128)])
def test_kernel_matches_reference(shape, dtype: torch.dtype) -> None:
    x, cos, sin = _inputs(*shape, dtype)
    got, ref = triton_apply_rope(x, cos, sin), _reference(x, cos, sin)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    else:  # the same roundings in the same order: equal bits
        assert torch.equal(got, ref)
    for i in range(x.shape[0]):
        assert torch.equal(triton_apply_rope(x[i : i + 1], cos[i : i + 1], sin[i : i + 1])[0], got[i])


def test_cpu_path_is_the_reference() -> None:
    x, cos, sin = _inputs(4, 2, 64, 32, torch.bfloat16)
    assert torch.equal(rope_ops.apply_rope(x, cos, sin), _reference(x, cos, sin))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_rope(dtype: torch.dtype) -> None:
    x, cos, sin = _inputs(33, 24, 256, 64, dtype, device="cuda")
    got = rope_ops.apply_rope(x, cos, sin)
    ref = _reference(x.cpu(), cos.cpu(), sin.cpu())
    torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])
    for i in (0, 17, 32):
        assert torch.equal(rope_ops.apply_rope(x[i : i + 1], cos[i : i + 1], sin[i : i + 1])[0], got[i])
