"""Maximum over the last dimension of a float32 (128, 1024) tensor -> (128,) (level 2, reduction).

Reference for the ``kernels`` task ``level2/max_dim``; the CUDA solution ``max_dim.cu`` is called as ``forward(x)``.
"""

from __future__ import annotations

import torch
from torch import nn

SHAPE = (128, 1024)


class Model(nn.Module):
    def __init__(self, dim: int = 1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.amax(x, dim=self.dim)  # (128,)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(*SHAPE)]


def get_init_inputs() -> list:
    return [1]
