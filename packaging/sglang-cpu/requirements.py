"""Print what SGLang's pure-PyTorch CPU path needs (run with the SGLang virtualenv's Python after
``pip install --no-deps sglang==0.5.21``): its own requirements minus the GPU-only ones and the ones
that break with ``torch==2.13.0+cpu`` (they pin another torch or pull CUDA wheels; the shims beside this file stand
in for ``sgl_kernel`` and ``torchvision``). Used by the SGLang-on-CPU trial of 2026-12-05 (docs/engines.md); ``make
sglang`` is to use it as ``make vllm`` uses packaging/vllm-cpu/requirements.py.
"""

from __future__ import annotations

import importlib.metadata
import re

GPU_ONLY = {
    "cuda-python",
    "cuda-tile",
    "flash-attn-4",
    "flashinfer-python",
    "humming-kernels",
    "kernels",
    "nvidia-cutlass-dsl",
    "nvidia-mathdx",
    "nvidia-ml-py",
    "nvshmem4py-cu13",
    "quack-kernels",
    "sgl-deep-ep",
    "sgl-deep-gemm",
    "sglang-kernel",
    "tilelang",
    "tokenspeed-mla",
    "torch-memory-saver",
}
BROKEN = {"torch", "torchaudio", "torchcodec", "torchvision", "timm", "numba"}


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match is not None, requirement
    return match.group(0).lower().replace("_", "-")


def main() -> None:
    requires = [r for r in importlib.metadata.requires("sglang") or [] if "extra ==" not in r]
    print("\n".join(r for r in requires if _name(r) not in GPU_ONLY | BROKEN))


if __name__ == "__main__":
    main()
