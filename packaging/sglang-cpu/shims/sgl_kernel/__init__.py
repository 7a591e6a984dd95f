"""Import-only stand-in for SGLang's compiled CPU kernel library (loopwise trial shim).

SGLang's CPU engine imports a few ``*_cpu`` functions from ``sgl_kernel`` at module load even on its
pure-PyTorch path (mem_cache/allocation.py, speculative/*). They are only called for speculative
decoding, HiCache and mamba; here they raise. No ``torch.ops.sgl_kernel`` ops are registered, so
``cpu_has_amx_support()`` is false and SGLang takes its native-torch fallbacks everywhere.

Importing this module also applies the pin-memory patch (see ``_pin_memory``), because SGLang's
scheduler process imports ``sgl_kernel`` before it builds any LoRA layer.
"""

from __future__ import annotations

from sgl_kernel import _pin_memory

_pin_memory.apply()

__version__ = "0.0.0+loopwise.stub"


def __getattr__(name: str):
    if name.endswith("_cpu"):

        def _missing(*args, **kwargs):
            raise NotImplementedError(f"sgl_kernel.{name}: loopwise's import-only stub has no CPU kernels")

        _missing.__name__ = name
        return _missing
    raise AttributeError(f"module 'sgl_kernel' has no attribute {name!r} (loopwise import-only stub)")
