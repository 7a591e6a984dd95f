"""Check SGLang's CPU virtualenv, for ``make sglang`` (run with that virtualenv's Python, after the install).

``python check.py`` exits non-zero, saying why, unless:

- the installed distributions are exactly ``constraints.txt`` beside this file (name and version; ``pip`` aside,
  torch's ``+cpu`` label aside), so the virtualenv is the one the CPU trial ran, on any machine;
- no ``torchvision`` or ``sgl-kernel`` distribution is installed (the shims stand in for both and must stay without
  metadata: transformers would otherwise use the torchvision stub);
- with ``SGLANG_USE_CPU_ENGINE=1``, SGLang's scheduler and HTTP server import (through the shims) and SGLang sees
  no AMX kernels, so it takes its pure-PyTorch path.

``make sglang`` writes its stamp only after this passes, which is also how an existing virtualenv built by hand
the same way is taken as installed. Not here: starting a server (``make test-engines`` does).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned() -> dict[str, str]:
    pins = {}
    for line in (HERE / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[_key(name)] = version
    return pins


def installed() -> dict[str, str]:
    return {_key(d.metadata["Name"]): d.version.split("+", 1)[0] for d in importlib.metadata.distributions()}


def problems() -> list[str]:
    want, have = pinned(), installed()
    have.pop("pip", None)
    out = [f"{n} {have.get(n, 'missing')} (constraints.txt: {v})" for n, v in sorted(want.items()) if have.get(n) != v]
    out += [f"{n} {v} is installed but not in constraints.txt" for n, v in sorted(have.items()) if n not in want]
    out += [f"a {n} distribution is installed: the shim stands in for it" for n in ("torchvision", "sgl-kernel") if n in have]
    return out


def main() -> None:
    found = problems()
    if found:
        sys.exit("SGLang's virtualenv does not match packaging/sglang-cpu:\n  " + "\n  ".join(found))
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    import sglang.srt.entrypoints.http_server
    import sglang.srt.managers.scheduler  # noqa: F401
    from sglang.srt.utils.common import cpu_has_amx_support

    if cpu_has_amx_support():
        sys.exit("SGLang found AMX kernels: the sgl_kernel shim is not the one imported")
    print(f"SGLang's CPU virtualenv is complete: {len(pinned())} pinned packages, shims in place")


if __name__ == "__main__":
    main()
