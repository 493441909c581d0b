"""Triton GPU kernels. Each has a plain PyTorch reference in nextserve/ops (its oracle, C4)."""

import torch

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def use_kernel(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES) -> bool:
    """Whether an op runs its Triton kernel: every tensor on CUDA in a dtype the kernels take (float64
    and CPU tensors run the PyTorch reference). Integer ops pass their own `dtypes`."""
    return all(t.is_cuda and t.dtype in dtypes for t in tensors)
