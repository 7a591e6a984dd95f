"""Matrix-vector product of a float32 (1024, 2048) matrix and a (2048, 1) column -> (1024, 1) (level 3, matmul).

Reference for the ``kernels`` task ``level3/matvec``; the CUDA solution ``matvec.cu`` is called as ``forward(a, v)``.
"""

from __future__ import annotations

import torch
from torch import nn

M, K = 1024, 2048


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, v)  # (M, K) @ (K, 1) -> (M, 1)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(M, K), torch.randn(K, 1)]


def get_init_inputs() -> list:
    return []
