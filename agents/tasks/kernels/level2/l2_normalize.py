"""L2 normalisation of each row: x / max(||x||_2, 1e-12), float32 (128, 1024) (level 2, norm).

Reference for the ``kernels`` task ``level2/l2_normalize``; the CUDA solution ``l2_normalize.cu`` is called as ``forward(x)``.
"""

from __future__ import annotations

import torch
from torch import nn

SHAPE = (128, 1024)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(x, p=2.0, dim=1, eps=1e-12)  # (128, 1024)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(*SHAPE)]


def get_init_inputs() -> list:
    return []
