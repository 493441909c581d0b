"""Parameter holders named like the checkpoint, so state-dict keys match transformers' names."""

import torch
from torch import nn


class Weight(nn.Module):
    """A module with one `weight` (a projection matrix or a norm vector); its op is called elsewhere."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape), requires_grad=False)
