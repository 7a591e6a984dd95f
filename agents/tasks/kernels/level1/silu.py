"""SiLU (swish): x * sigmoid(x), on a float32 (128, 4096) tensor (level 1, element-wise).

Reference for the ``kernels`` task ``level1/silu``: ``Model()(*get_inputs())``. The CUDA solution next to this
file (``silu.cu``) is called as ``forward(x)``.
"""

from __future__ import annotations

import torch
from torch import nn

SHAPE = (128, 4096)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(*SHAPE)]


def get_init_inputs() -> list:
    return []
