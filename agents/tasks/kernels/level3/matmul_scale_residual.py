"""(x @ weight) * 0.5 + residual with x (128, 512), a learnable weight (512, 256) and residual (128, 256), float32 (level 3, fused block).

Reference for the ``kernels`` task ``level3/matmul_scale_residual``; the CUDA solution ``matmul_scale_residual.cu``
is called as ``forward(x, residual, weight)`` (the inputs, then ``model.parameters()``).
"""

from __future__ import annotations

import torch
from torch import nn

BATCH, IN, OUT = 128, 512, 256


class Model(nn.Module):
    def __init__(self, in_features: int = IN, out_features: int = OUT, scale: float = 0.5) -> None:
        super().__init__()
        self.scale = scale
        self.weight = nn.Parameter(torch.randn(in_features, out_features) / in_features**0.5)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.weight) * self.scale + residual  # (BATCH, OUT)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(BATCH, IN), torch.randn(BATCH, OUT)]


def get_init_inputs() -> list:
    return [IN, OUT, 0.5]
