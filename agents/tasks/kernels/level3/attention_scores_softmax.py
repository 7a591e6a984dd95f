"""Attention probabilities softmax(q @ k.T / sqrt(d)) for q, k of float32 (16, 128, 64) -> (16, 128, 128) (level 3, fused block).

Sixteen (batch x head) slices, sequence 128, head size 64, no mask. Reference for the ``kernels`` task
``level3/attention_scores_softmax``; the CUDA solution ``attention_scores_softmax.cu`` is called as ``forward(q, k)``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

BH, S, D = 16, 128, 64


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (BH, S, S)
        return torch.softmax(scores, dim=-1)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(BH, S, D), torch.randn(BH, S, D)]


def get_init_inputs() -> list:
    return []
