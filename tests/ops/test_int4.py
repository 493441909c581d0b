"""W4A16 weights (ops/int4.py) against the compressed-tensors library, the format's own writer and reader:
packing, round-to-nearest quantization and dequantization give its bits, for every group size and dtype a
checkpoint ships, symmetric and asymmetric."""

from __future__ import annotations

import pytest
import torch

from nextserve.ops.int4 import Int4Weight, dequantize, pack_int4, quantize_int4, unpack_int4

ct = pytest.importorskip("compressed_tensors")  # a test dependency: pip install -e ".[test]"
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402


@pytest.mark.parametrize("shape", [(5, 16), (3, 4, 24), (7, 13), (1, 8)])
def test_packing_is_the_librarys(shape) -> None:
    q = torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    assert torch.equal(pack_int4(q), pack_to_int32(q, 4))
    assert torch.equal(unpack_int4(pack_int4(q), shape[-1]), q)
    assert torch.equal(unpack_from_int32(pack_int4(q), 4, torch.Size(shape)), q)


def _library(w: torch.Tensor, args: QuantizationArgs) -> dict:
    """What compressed-tensors writes for w: the observer's min-max qparams, then its compressor."""
    k = w.shape[-1]
    g = k if args.strategy == "channel" else args.group_size
    groups = w.float().unflatten(-1, (k // g, g))
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    state = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zero.to(torch.int8)}
    return PackedQuantizationCompressor.compress(state, QuantizationScheme(targets=["Linear"], weights=args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_round_to_nearest_quantization_is_the_librarys(dtype, group) -> None:
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(group)).to(dtype)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    lib = _library(w, args)
    ours = quantize_int4(w, group)
    assert torch.equal(ours.packed, lib["weight_packed"]) and torch.equal(ours.scale, lib["weight_scale"])
    back = PackedQuantizationCompressor.decompress(
        dict(lib), QuantizationScheme(targets=["Linear"], weights=args)
    )
    assert torch.equal(ours.dequantize(dtype), back["weight"])


@pytest.mark.parametrize("strategy", ["group", "channel"])
def test_asymmetric_dequantization_is_the_librarys(strategy) -> None:
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16) + 0.3
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy=strategy,
                            group_size=32 if strategy == "group" else None)  # fmt: skip
    lib = _library(w, args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    back = PackedQuantizationCompressor.decompress(dict(lib), scheme)["weight"]
    # the zero points are packed along the output dimension (the library's packed_dim 0)
    zero = unpack_int4(lib["weight_zero_point"].T.contiguous(), w.shape[0]).T
    ours = Int4Weight(lib["weight_packed"], lib["weight_scale"], zero, w.shape[-1])
    assert torch.equal(ours.dequantize(torch.bfloat16), back)
    assert (ours.dequantize(torch.float32) - w.float()).abs().max() < lib["weight_scale"].float().max()


def test_a_weight_is_rounded_to_its_scales_dtype_whatever_the_activations_and_bad_shapes_are_refused() -> (
    None
):
    w = quantize_int4(torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16), 16)
    q = unpack_int4(w.packed, 64).double()
    exact = q * w.scale.double().repeat_interleave(16, dim=-1)
    value = exact.to(torch.bfloat16)  # the library's weight: the product rounded to the scale's dtype
    assert torch.equal(dequantize(w.packed, w.scale, None, 64, torch.float64), value.double())
    assert torch.equal(dequantize(w.packed, w.scale, None, 64, torch.float32), value.float())
    assert not torch.equal(value.double(), exact)  # (the rounding is real)
    with pytest.raises(ValueError, match="packed width"):
        Int4Weight(w.packed[:, :1], w.scale, None, 64)
    with pytest.raises(ValueError, match="scale shape"):
        Int4Weight(w.packed, w.scale[:, :3], None, 64)
    with pytest.raises(ValueError, match="int32"):
        Int4Weight(w.packed.to(torch.int64), w.scale, None, 64)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_int4(torch.randn(4, 64), 48)
