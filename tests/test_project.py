"""House rules that live in the build files: what ``make`` runs keeps the suite's default deselections."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def markers_deselected(expr: str) -> set[str]:
    """The markers a ``-m`` expression of ``not a and not b ...`` form leaves out."""
    return set(re.findall(r"not\s+(\w+)", expr))


def test_test_fast_keeps_the_default_deselections() -> None:
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    default = markers_deselected(re.search(r"-m\s+'([^']+)'", addopts).group(1))
    assert {"gpu", "sglang", "torch_ext"} <= default
    recipe = re.search(r"^test-fast:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    fast = markers_deselected(re.search(r"-m\s+'([^']+)'", recipe).group(1))
    assert default | {"slow"} <= fast, f"make test-fast runs {sorted(default - fast)}, which `make test` leaves out"
