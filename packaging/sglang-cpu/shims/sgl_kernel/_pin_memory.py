"""Make ``pin_memory`` a no-op where torch has no accelerator (SGLang issue #31894: LoRA layers pin
tensors unconditionally and crash with "pin_memory=True requires a CUDA or other accelerator backend")."""

from __future__ import annotations

import functools

import torch

_FACTORIES = ("tensor", "zeros", "empty", "full", "ones", "as_tensor", "zeros_like", "empty_like")


def _drop_pin(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapper


def apply() -> None:
    if getattr(torch, "_loopwise_pin_patched", False):
        return
    if torch.accelerator.is_available():
        return
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
    for name in _FACTORIES:
        if hasattr(torch, name):
            setattr(torch, name, _drop_pin(getattr(torch, name)))
    torch._loopwise_pin_patched = True
