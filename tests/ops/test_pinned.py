"""`upload` on the CPU: the values of torch.tensor, in the dtype asked for (the CUDA path, a queued copy
through page-locked memory, is tests/gpu/test_no_sync.py's)."""

import numpy as np
import torch

from nextserve.ops.pinned import upload


def test_upload_gives_torch_tensors_values_and_dtype() -> None:
    t = upload([3, -1, 7], torch.long, "cpu")
    assert t.dtype == torch.long and t.tolist() == [3, -1, 7]
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    t = upload(a, torch.int32, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert upload([], torch.long, "cpu").shape == (0,)
