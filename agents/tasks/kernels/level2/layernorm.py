"""LayerNorm over the last dimension (1024, eps 1e-5, learnable weight and bias) of a float32 (128, 1024) tensor (level 2, norm).

Reference for the ``kernels`` task ``level2/layernorm``; the CUDA solution ``layernorm.cu`` is called as
``forward(x, weight, bias)`` (the input, then ``model.parameters()`` in order).
"""

from __future__ import annotations

import torch
from torch import nn

SHAPE = (128, 1024)


class Model(nn.Module):
    def __init__(self, dim: int = 1024) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=1e-5)
        with torch.no_grad():  # non-trivial affine parameters, so a kernel that ignores them fails
            self.norm.weight.add_(0.1 * torch.randn(dim))
            self.norm.bias.add_(0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)  # (128, 1024)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(*SHAPE) * 2.0 + 0.5]


def get_init_inputs() -> list:
    return [SHAPE[1]]
