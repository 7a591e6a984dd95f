"""SwiGLU MLP w2(silu(w1(x)) * w3(x)), dims 256 -> 512 -> 256, no biases, on a float32 (64, 256) batch (level 3, fused block).

Reference for the ``kernels`` task ``level3/swiglu_mlp``; the CUDA solution ``swiglu_mlp.cu`` is called as
``forward(x, w1, w2, w3)`` with the weights of ``w1`` (512, 256), ``w2`` (256, 512) and ``w3`` (512, 256) in
registration order (``model.parameters()``).
"""

from __future__ import annotations

import torch
from torch import nn

BATCH, DIM, HIDDEN = 64, 256, 512


class Model(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(self.w1(x)) * self.w3(x)  # (BATCH, HIDDEN)
        return self.w2(h)  # (BATCH, DIM)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(BATCH, DIM)]


def get_init_inputs() -> list:
    return [DIM, HIDDEN]
