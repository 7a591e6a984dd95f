"""Matrix product A @ B of float32 (256, 512) and (512, 384) matrices -> (256, 384) (level 3, matmul).

Reference for the ``kernels`` task ``level3/matmul``; the CUDA solution ``matmul.cu`` is called as ``forward(a, b)``.
"""

from __future__ import annotations

import torch
from torch import nn

M, K, N = 256, 512, 384


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)  # (M, K) @ (K, N) -> (M, N)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(M, K), torch.randn(K, N)]


def get_init_inputs() -> list:
    return []
