"""Inclusive cumulative sum along the last dimension of a float32 (128, 1024) tensor (level 2, scan).

Reference for the ``kernels`` task ``level2/cumsum``; the CUDA solution ``cumsum.cu`` is called as ``forward(x)``.
"""

from __future__ import annotations

import torch
from torch import nn

SHAPE = (128, 1024)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x, dim=1)  # (128, 1024)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(*SHAPE)]


def get_init_inputs() -> list:
    return []
