"""Test reference (KernelBench style): y = x * weight + 1, with a learnable per-column weight."""

import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, columns: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(columns))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + 1.0


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(256, 1024)]


def get_init_inputs() -> list[int]:
    return [1024]
