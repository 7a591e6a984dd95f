"""Compiled kernels for the embedded engine on CPUs with AVX512-BF16 and no AMX (``csrc/cpu_kernels.cpp``).

Five ops: ``prompt_attention`` (a prompt chunk's causal attention over its staging buffer), ``decode_attention`` (one
token per row over a KV pool: it writes the step's key and value into the pool, then reads only each row's live keys),
the two elementwise passes around them, ``rms_norm`` and the in-place rotary embedding ``rope_`` (one pass each
instead of PyTorch's four or five; rounding where transformers' bf16 modules round: the rotary bit for bit, the norm up
to the order of its fp32 sum), and the sampler's ``argmax_lse`` (each row's first argmax and log-sum-exp of fp32
logits, 0.6 vs 5.4 ms for 64 rows of a 49k vocabulary: the embedded engine uses it with any runner). Why: on
such a CPU (AMD Zen 4, Intel Cooper Lake), PyTorch's CPU flash attention has no bf16 matrix unit to use and ran at ~42
ms a layer for a 1,990-token prompt on SmolLM2 (half of the prefill, fp32 and bf16 alike), the decode path's batched
GEMMs read every column of a pool under a mask, and the small elementwise ops cost more in dispatch than in arithmetic
at decode shapes. The attention kernels use the CPU's bf16 pair dot products. Where AMX exists, PyTorch's kernels use
it and stay; without AVX512-BF16, or for a shape the kernels do not take, ``ops()`` is None and the runner uses
PyTorch's ops.

The kernels are compiled once per machine with ``torch.utils.cpp_extension`` (g++ and ninja, ~15 s; ``make install``
does it, else the first engine start) into ``$LOOPWISE_KERNEL_DIR`` (default ``~/.cache/loopwise/kernels``), keyed
by the source, torch's version and the flags. ``LOOPWISE_CPU_KERNELS=torch`` turns them off. A failed build logs why
once and leaves the torch path.

Not here: other dtypes or ISAs (AVX2-only CPUs serve fp32 through PyTorch).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from runtime.engines.cpu_linear import cpu_flags

log = structlog.get_logger()
SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-fno-math-errno", "-fopenmp"]
_lock = threading.Lock()


@dataclass(frozen=True)
class Ops:
    prompt: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]  # q, k, v, start, scale
    # q, k, v, lengths, scale[, k_new, v_new: written into the pools at each row's length first]
    decode: Callable[..., torch.Tensor]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # x (N, d), weight, eps
    rope_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None]  # x (N, >= heads, D) in place, cos, sin (N, D), heads
    argmax_lse: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # logits (B, V) fp32 -> first argmax, log-sum-exp


def why_not() -> str | None:
    """None when this machine should use the kernel; else why not (before any build)."""
    if os.environ.get("LOOPWISE_CPU_KERNELS", "").lower() == "torch":
        return "LOOPWISE_CPU_KERNELS=torch"
    flags = cpu_flags()
    if "avx512_bf16" not in flags:
        return "the CPU has no AVX512-BF16"
    if "amx_bf16" in flags:
        return "the CPU has AMX (PyTorch's flash attention uses it)"
    return None


def build_dir() -> Path:
    root = Path(os.environ.get("LOOPWISE_KERNEL_DIR") or Path.home() / ".cache" / "loopwise" / "kernels").expanduser()
    key = hashlib.sha1(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(_FLAGS).encode() + sys.version.encode()).hexdigest()[:12]
    return root / f"cpu_kernels-{key}"


@functools.cache
def ops() -> Ops | None:
    """The ops built and loaded, or None (with one log line saying why)."""
    reason = why_not()
    if reason is not None:
        return None
    with _lock:
        try:
            from torch.utils import cpp_extension

            where = build_dir()
            where.mkdir(parents=True, exist_ok=True)
            if not (where / "loopwise_cpu_kernels.so").exists():
                log.info("cpu_kernels.build", dir=str(where), note="once per machine, ~15 s")
            cpp_extension.load(
                name="loopwise_cpu_kernels",
                sources=[str(SOURCE)],
                extra_cflags=_FLAGS,
                extra_ldflags=["-fopenmp"],  # ATen's parallel_for is OpenMP pragmas in headers; libgomp is torch's own at run time
                build_directory=str(where),
                is_python_module=False,
                verbose=False,
            )
        except Exception as exc:  # no compiler, no ninja, an assembler without AVX512-BF16: the torch path serves
            log.warning("cpu_kernels.unavailable", error=f"{type(exc).__name__}: {exc}"[:500])
            return None
    lw = torch.ops.loopwise
    return Ops(prompt=lw.prompt_attention, decode=lw.decode_attention, rms_norm=lw.rms_norm, rope_=lw.rope_, argmax_lse=lw.argmax_lse)


def takes(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernels compute this shape (bf16, head dim a multiple of 64 up to 256)."""
    return dtype == torch.bfloat16 and head_dim % 64 == 0 and head_dim <= 256


if __name__ == "__main__":  # `make install`: build them now rather than at the first engine start
    reason = why_not()
    if reason is not None:
        print(f"cpu kernels: not used here ({reason})")
    else:
        print(f"cpu kernels: {'built' if ops() is not None else 'not built (see the warning)'} in {build_dir()}")
