"""A @ B.T of float32 (256, 512) and (384, 512) matrices -> (256, 384) (level 3, matmul).

Reference for the ``kernels`` task ``level3/matmul_transposed``; the CUDA solution ``matmul_transposed.cu`` is called as ``forward(a, b)``.
"""

from __future__ import annotations

import torch
from torch import nn

M, K, N = 256, 512, 384


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b.T)  # (M, K) @ (N, K).T -> (M, N)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(M, K), torch.randn(N, K)]


def get_init_inputs() -> list:
    return []
