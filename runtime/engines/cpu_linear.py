"""Faster fp32 ``nn.Linear`` on CPU: oneDNN prepacked weights instead of the default MKL GEMM.

Measured on this project's 2-core AVX2 machine (SmolLM2's 49152×576 lm_head): batch 1 5.7 ms vs 10.9 ms,
batch 16 11.1 ms vs 28.5 ms. Decoding is dominated by these matmuls, so this is most of the engine's
CPU speed. This is the same kernel PyTorch's inductor emits for CPU linears
(``mkldnn._reorder_linear_weight`` + ``mkldnn._linear_pointwise``).

``pack_linears(model)`` patches each eligible module's ``forward`` in place and keeps its ``weight``
parameter, so the module is still an ``nn.Linear`` (peft can wrap it; ``state_dict`` is unchanged).
The packed copy costs the weights' memory once more. Inference only: the packed path has no autograd.

Not here: bf16/int8 kernels (bf16 is slower than fp32 at batch > 1 on CPUs without native bf16).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


def packed_linear_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_linears(model: nn.Module) -> int:
    """Route every fp32 CPU ``nn.Linear`` in ``model`` through a prepacked oneDNN weight. Returns how many."""
    if not packed_linear_available():
        log.info("oneDNN packed linear unavailable; using the default matmul")
        return 0
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
            _pack(module)
            count += 1
    return count


def _pack(module: nn.Linear) -> None:
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
    bias = module.bias.detach() if module.bias is not None else None

    def forward(x: torch.Tensor, _packed: Any = packed, _bias: Any = bias) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:  # training through this module: the plain path
            return nn.functional.linear(x, module.weight, module.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), _packed, _bias, "none", [], "")

    module.forward = forward  # type: ignore[method-assign]
