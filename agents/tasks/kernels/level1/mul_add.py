"""Fused multiply-add of three tensors: x * y + z, on a float32 (128, 4096) tensors (level 1, element-wise).

Reference for the ``kernels`` task ``level1/mul_add``: ``Model()(*get_inputs())``. The CUDA solution next to this
file (``mul_add.cu``) is called as ``forward(x, y, z)``.
"""

from __future__ import annotations

import torch
from torch import nn

SHAPE = (128, 4096)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return x * y + z


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(*SHAPE), torch.randn(*SHAPE), torch.randn(*SHAPE)]


def get_init_inputs() -> list:
    return []
