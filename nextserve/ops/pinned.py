"""Page-locked host memory of exactly the size asked for, for tables the GPU reads over the bus.

# NOTE: torch's pinned allocator (`pin_memory=True`) rounds every allocation up to a power of two (its
# free lists are indexed by size class), so the released n-gram table (95.4 GiB in bf16) asked for 128 GiB
# of page-locked memory and failed on a 125 GiB host. Here the pages are an anonymous mapping of the exact
# size, registered with CUDA (cudaHostRegister, portable and mapped: under unified addressing the host
# pointer is the device pointer a kernel reads through), and unregistered when the last tensor viewing
# them is freed.
"""

from __future__ import annotations

import math
import mmap

import torch

_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


class _RegisteredPages(mmap.mmap):
    """An anonymous mapping that stays registered with CUDA until it is freed (tensors hold it alive)."""

    addr = 0

    def __del__(self) -> None:
        if self.addr:
            torch.cuda.cudart().cudaHostUnregister(self.addr)
            self.addr = 0


def pinned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor in page-locked memory of exactly its own size (a CUDA
    device must be present). Raises MemoryError naming the size when the host cannot lock it."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    pages = _RegisteredPages(-1, nbytes)
    raw = torch.frombuffer(pages, dtype=torch.uint8)  # NOTE: its storage keeps `pages` alive
    err = torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), nbytes, _PORTABLE_MAPPED)
    if int(err) != 0:
        raise MemoryError(
            f"cannot lock {nbytes / 2**30:.2f} GiB of host memory for the GPU to read (CUDA error "
            f"{int(err)}): free host memory, or keep the table on the device (--ple-table device)"
        )
    pages.addr = raw.data_ptr()
    return raw.view(dtype).view(shape)


def upload(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` (values: a list or a numpy array) without making
    the host wait for the device.

    # NOTE: torch copies pageable host memory to a GPU synchronously: the host waits until every kernel
    # queued before the copy has run. A prefill step's inputs (token ids, positions, a grown block table)
    # made the host wait for all the work queued so far at each step's start and at each chunk's first
    # attention layer. Through page-locked memory the copy is queued on the current stream like a kernel;
    # torch's pinned allocator keeps the staging block until the copy has run (it records the copy on the
    # stream), so the host may drop it at once. Measured on an H200 (BENCHMARKS.md,
    # Long prefill): the same TTFT as the blocking copy for 1K and 16K prompts."""
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
