"""Batched matrix product of float32 (8, 128, 256) and (8, 256, 128) -> (8, 128, 128) (level 3, matmul).

Reference for the ``kernels`` task ``level3/bmm``; the CUDA solution ``bmm.cu`` is called as ``forward(a, b)``.
"""

from __future__ import annotations

import torch
from torch import nn

B, M, K, N = 8, 128, 256, 128


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a, b)  # (B, M, K) @ (B, K, N) -> (B, M, N)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(B, M, K), torch.randn(B, K, N)]


def get_init_inputs() -> list:
    return []
