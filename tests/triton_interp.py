"""Where the Triton kernel tests run, shared by tests/ops: without a GPU, in Triton's interpreter on CPU
tensors (tests/conftest.py sets TRITON_INTERPRET=1 then), else on CUDA; and a row-independent tl.dot
for the interpreter's row-invariance tests."""

import os

import numpy as np
import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# NOTE: the small tests run wherever the kernels can: in the interpreter on CPU tensors, else on CUDA.
DEV = "cpu" if INTERPRET else "cuda"
small = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="no Triton backend")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def row_independent_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the interpreter, make tl.dot give each output element from its own row and column by one
    fixed computation, as a GPU MMA does (on CUDA: nothing to patch).
    # NOTE: the interpreter's tl.dot is np.matmul, i.e. the CPU BLAS, whose kernels may round a row
    # differently by its position in the tile (rows 6-11 of 16 on some CPUs); that is the emulator's
    # property, not the kernel's, so the invariance of the kernel's own structure (tiling, splits,
    # blocks, gathers, masks, fixed-order sums, M) is checked with a dot that has none (exact products
    # of the float32-widened inputs, added over k in order). The MMA itself is checked on the GPU."""
    if not INTERPRET:
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle, _convert_float

    def values(t) -> np.ndarray:
        """A dot operand as float32 (E4M3 codes are held as their bits: widened as the interpreter does)."""
        if t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating():
            return _convert_float(t.data, t.dtype, tl.float16, None).view(np.float16).astype(np.float32)
        return t.data.astype(np.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        prod = values(a)[:, :, None] * values(b)[None, :, :]
        acc = d.data.copy()
        for k in range(prod.shape[1]):
            acc += prod[:, k, :]
        return TensorHandle(acc, d.dtype.scalar)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", dot)
