"""Linear layer (512 -> 256, with bias) then ReLU on a float32 (128, 512) batch (level 3, fused block).

Reference for the ``kernels`` task ``level3/linear_relu``; the CUDA solution ``linear_relu.cu`` is called as
``forward(x, weight, bias)`` with ``weight`` (256, 512) and ``bias`` (256,) from ``model.parameters()``.
"""

from __future__ import annotations

import torch
from torch import nn

BATCH, IN, OUT = 128, 512, 256


class Model(nn.Module):
    def __init__(self, in_features: int = IN, out_features: int = OUT) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))  # (BATCH, OUT)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(BATCH, IN)]


def get_init_inputs() -> list:
    return [IN, OUT]
