"""Element-wise sum of two tensors of the same shape, on a float32 (128, 4096) tensors (level 1, element-wise).

Reference for the ``kernels`` task ``level1/add``: ``Model()(*get_inputs())``. The CUDA solution next to this
file (``add.cu``) is called as ``forward(x, y)``.
"""

from __future__ import annotations

import torch
from torch import nn

SHAPE = (128, 4096)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(*SHAPE), torch.randn(*SHAPE)]


def get_init_inputs() -> list:
    return []
