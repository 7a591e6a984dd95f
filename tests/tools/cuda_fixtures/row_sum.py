"""Test reference (KernelBench style): the sum of each row, no parameters."""

import torch
from torch import nn


class Model(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=1)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(512, 2048)]


def get_init_inputs() -> list[int]:
    return []
