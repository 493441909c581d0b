"""Pieces the kernels share: the sigmoid they all round the same way, the unit-stride view their wrappers
pass (column slices of a stacked projection are read in place), programmatic dependent launch, and the
tile counters of one-launch reductions.

# NOTE: programmatic dependent launch (PDL, sm_90+). A kernel launched with `launch_pdl` may start while
# the kernel before it in the stream is still running; a decode step is a chain of ~300 kernels of a few
# microseconds, so each one's launch and first loads then overlap the previous one's tail. The contract
# every kernel launched with `launch_pdl(...)` keeps (`pdl_start` near its top):
# - it reads nothing an earlier kernel writes, and writes nothing, before `gdc_wait` returns (which is
#   when the previous grid has completed and its writes are visible). `pdl_start` comes before every
#   such read; only weights, which no kernel writes, are loaded before it: the small-M GEMM loads a short
#   split's weight tiles into registers first (gemv.py, PRELOAD: 1.6% less GPU time a c1 step,
#   BENCHMARKS.md, Tried and dropped), where prefetching them into L2 had measured no better than not;
# - it calls `gdc_wait` unconditionally, so "the previous grid completed" chains back through every
#   kernel: a kernel that skipped the wait could complete before its own predecessor.
# Kernels without the attribute (torch's) are ordered by the stream as usual. PDL changes when a kernel
# starts, never what it computes: the bits are the same on or off (tests/gpu/test_pdl.py).
"""

import functools

import torch
import triton
import triton.language as tl

from ..pdl import _PDL

COUNTERS = 1 << 16  # tile counters of the one-launch split reductions (a call with more tiles uses two)
_COUNTERS: dict[torch.device, torch.Tensor] = {}


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_pdl(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL: on, and a CUDA device of sm_90 or newer."""
    return _PDL[0] and t.is_cuda and _pdl_capable(t.device)


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Let the next kernel launch now, then wait for the previous kernel (see the NOTE above)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def sigmoid(v):
    """1 / (1 + exp(-v)) in float32, as torch's CUDA sigmoid computes it before rounding."""
    return 1.0 / (1.0 + tl.exp(-v))


# E4M3 codes to bf16 by bit moves: each code's sign, exponent and mantissa moved into a bf16 (the value
# times 2^-120, subnormal codes included), then one bf16x2 multiply by 2^120 (exact: every E4M3 value is a
# bf16; -0 added, so a zero keeps its sign). Four codes per instance (one 32-bit register in, two out, code
# 0 in the low half of $0).
_E4M3_TO_BF16 = tl.constexpr(
    """{
    .reg .b32 lo, hi, s, bias, nzero;
    mov.b32 bias, 0x7B807B80;
    mov.b32 nzero, 0x80008000;
    prmt.b32 lo, $2, 0, 0x1404;
    prmt.b32 hi, $2, 0, 0x3424;
    shr.b32 s, lo, 4;
    and.b32 s, s, 0x07F007F0;
    and.b32 lo, lo, 0x80008000;
    or.b32 lo, lo, s;
    fma.rn.bf16x2 $0, lo, bias, nzero;
    shr.b32 s, hi, 4;
    and.b32 s, s, 0x07F007F0;
    and.b32 hi, hi, 0x80008000;
    or.b32 hi, hi, s;
    fma.rn.bf16x2 $1, hi, bias, nzero;
}"""
)


# NOTE: a process-wide switch, for side-by-side benchmarks and the tests that compare both conversions
FP8_BIT_MOVES = [True]


def fp8_bit_moves(t: torch.Tensor) -> bool:
    """Whether FP8 kernels on t's device turn codes into bf16 by `fp8_codes`' bit moves (on a GPU)."""
    return FP8_BIT_MOVES[0] and t.is_cuda


@triton.jit
def fp8_codes(w, ty: tl.constexpr, FAST: tl.constexpr):
    """The E4M3 tensor w's values in ty, exactly (every finite E4M3 value is a 16-bit float). FAST (ty
    bf16, on a GPU): by the bit moves of _E4M3_TO_BF16, three integer ops and a multiply per two codes,
    where Triton's own conversion runs five conversion instructions per two (e4m3 -> f16 -> f32 -> bf16),
    which held the FP8 GEMV near 2e12 codes a second on an H200. The same bits either way, NaN codes
    (none in a checkpoint) aside."""
    if FAST:
        return tl.inline_asm_elementwise(
            _E4M3_TO_BF16, "=r,=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=4
        )
    return w.to(ty)


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is contiguous (any row stride), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def pdl_args(t: torch.Tensor) -> dict:
    """The launch keywords of a kernel that starts with `pdl_start(PDL)`, for a launch on t's device."""
    on = launch_pdl(t)
    return {"PDL": on, "launch_pdl": on}


def tile_counters(device: torch.device) -> torch.Tensor | None:
    """Zeroed int32 tile counters of `device` (None while a CUDA graph is being captured and they do
    not exist yet: they would be allocated from, and zeroed by, the graph's pool). Each call of a kernel
    that uses them leaves them zero again; calls on one device run in stream order (the engine uses one
    stream, and a PDL launch touches them only after its wait), so no two calls use a counter at once."""
    cnt = _COUNTERS.get(device)
    if cnt is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        cnt = _COUNTERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return cnt
