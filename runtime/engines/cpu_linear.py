"""Faster CPU linears: oneDNN prepacked weights instead of the default GEMM, optionally several fused into one.

Measured on this project's 2-core machines, one thread, SmolLM2's shapes:
- fp32 (AVX2 machine, 49152×576 lm_head): batch 1 5.7 ms vs 10.9 ms, batch 16 11.1 ms vs 28.5 ms;
- bf16 (AVX512-BF16, no AMX): batch 1 gate|up 3072×576 56 µs vs 208 µs, lm_head 2.8 ms vs 9.0 ms;
  batch 16 down 1536→576 76 µs vs 309 µs.
This is the kernel PyTorch's inductor emits for CPU linears (``mkldnn._reorder_linear_weight`` +
``mkldnn._linear_pointwise``); the results equal ``F.linear``'s bit for bit on these shapes.

- ``pack([q, k, v])`` returns a ``Packed`` callable for the row-stacked weights of the given linears
  (one GEMM for q, k and v; the caller slices the output), used by ``llama_runner``.
- ``pack_linears(model)`` patches each eligible module's ``forward`` in place and keeps its
  ``weight`` parameter, so the module is still an ``nn.Linear`` (LoRA sites wrap it; ``state_dict``
  is unchanged); used by ``hf_runner``.

Either way the packed copy costs the weights' memory once more. Inference only: no autograd. bf16 weights are
packed only where oneDNN can on this CPU (``bf16_packable``: AVX-512 BW/VL/DQ or AVX-NE-CONVERT); elsewhere,
e.g. an AVX2-only CPU running ``--dtype bfloat16``, they go through ``F.linear``.

Not here: int8 kernels, fp16.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

_PACKABLE = (torch.float32, torch.bfloat16)


def packed_linear_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s ``flags`` words: ``amx_bf16``, ``avx512_bf16``, ...); empty where
    they cannot be read. Read once per process."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(w for line in text.splitlines() if line.startswith("flags") for w in line.partition(":")[2].split())


def bf16_packable() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only
    CPU refuses with a RuntimeError): probed once on a tiny weight. Where it cannot, bf16 linears use ``F.linear``."""
    if not packed_linear_available():
        return False
    try:
        with torch.no_grad():
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError as exc:
        log.info("oneDNN cannot pack bf16 weights on this CPU (%s); bf16 linears use the default matmul", str(exc).splitlines()[0])
        return False
    return True


class Packed:
    """``y = x @ W^T + b`` for ``W`` (out, in); prepacked for oneDNN where it can be, else ``F.linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.bias = bias
        self.onednn = (
            packed_linear_available()
            and weight.device.type == "cpu"
            and weight.dtype in _PACKABLE
            and (weight.dtype != torch.bfloat16 or bf16_packable())
        )
        with torch.no_grad():
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.onednn else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._unary(x, "none")

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x @ W^T + b)``, the activation in the GEMM's epilogue where oneDNN runs it (oneDNN's ``swish``)."""
        return self._unary(x, "swish")

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b + other`` (a residual) in one pass where oneDNN runs it; ``other`` is not changed."""
        return self._binary(x, other, "add")

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``(x @ W^T + b) * other`` (SwiGLU's up projection times the activated gate) in one pass where oneDNN runs it."""
        return self._binary(x, other, "mul")

    def _unary(self, x: torch.Tensor, attr: str) -> torch.Tensor:
        if self.onednn:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, attr, [], "")
            return out
        y = F.linear(x, self.weight, self.bias)
        return F.silu(y) if attr == "swish" else y

    def _binary(self, x: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
        if self.onednn:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), other.contiguous(), self.weight, self.bias, op)
            return out
        y = F.linear(x, self.weight, self.bias)
        return y + other if op == "add" else y * other


def pack(modules: Sequence[nn.Linear]) -> Packed:
    """One ``Packed`` for the linears' weights stacked by output rows (their outputs side by side)."""
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in modules]) if len(modules) > 1 else modules[0].weight.detach()
        bias = None
        if any(m.bias is not None for m in modules):
            parts = [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in modules]
            bias = torch.cat(parts)
    return Packed(weight.contiguous(), bias)


def pack_linears(model: nn.Module) -> int:
    """Route every fp32/bf16 CPU ``nn.Linear`` in ``model`` through a prepacked oneDNN weight. Returns how many."""
    if not packed_linear_available():
        log.info("oneDNN packed linear unavailable; using the default matmul")
        return 0
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear or module.weight.device.type != "cpu":
            continue
        if module.weight.dtype in _PACKABLE and (module.weight.dtype != torch.bfloat16 or bf16_packable()):
            _pack(module)
            count += 1
    return count


def _pack(module: nn.Linear) -> None:
    packed = pack([module])

    def forward(x: torch.Tensor, _packed: Packed = packed) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:  # training through this module: the plain path
            return nn.functional.linear(x, module.weight, module.bias)
        return _packed(x)

    module.forward = forward  # type: ignore[method-assign, assignment]
