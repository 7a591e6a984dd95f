"""RMSNorm over the last dimension (eps 1e-6, learnable weight): x / sqrt(mean(x^2) + eps) * weight, float32 (128, 1024) (level 2, norm).

Reference for the ``kernels`` task ``level2/rmsnorm``; the CUDA solution ``rmsnorm.cu`` is called as ``forward(x, weight)``.
"""

from __future__ import annotations

import torch
from torch import nn

SHAPE = (128, 1024)


class Model(nn.Module):
    def __init__(self, dim: int = 1024, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (128, 1)
        return x * rms * self.weight  # (128, 1024)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(*SHAPE)]


def get_init_inputs() -> list:
    return [SHAPE[1]]
