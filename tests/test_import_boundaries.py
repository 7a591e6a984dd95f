"""Light modules stay torch-free: the runtime's protocol and schema modules, and every module of agents, memory and tools.

The layering between packages (which package imports which) is checked over the sources in ``test_import_rules.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def heavy_modules_after(imports: list[str]) -> dict[str, bool]:
    """Import ``imports`` in a fresh interpreter; report which heavy libraries got loaded."""
    code = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in imports)
        + "print(json.dumps({k: k in sys.modules for k in ('torch', 'transformers', 'xgrammar')}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_light_runtime_modules_do_not_import_torch() -> None:
    loaded = heavy_modules_after(["runtime.tool_parsers", "runtime.api.openai_schemas", "runtime.settings", "runtime.errors", "runtime.engine"])
    assert loaded == {"torch": False, "transformers": False, "xgrammar": False}


def modules_of(package: str) -> list[str]:
    names = []
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


# the kernel tasks' reference programs are PyTorch modules: they run in the sandbox, and import torch on purpose
KERNEL_REFERENCES = re.compile(r"agents\.tasks\.kernels\.level\d+\.")
LIGHT_LEARNER = [
    "learner.records",
    "learner.records.adapter_manifest",
    "learner.advantages",
    "learner.samples",
    "learner.records.store",
    "learner.config",
]


def test_agents_memory_tools_and_the_learners_data_modules_do_not_import_torch() -> None:
    # every real module (not the packages' empty __init__ files): serving agents never loads training code
    modules = [m for pkg in ("agents", "memory", "tools") for m in modules_of(pkg) if not KERNEL_REFERENCES.match(m)]
    assert len(modules) > 40
    loaded = heavy_modules_after([*modules, *LIGHT_LEARNER])
    assert loaded["torch"] is False
    assert loaded["transformers"] is False


def test_the_check_detects_torch() -> None:
    # the subprocess probe itself works: importing the engine module does load torch
    assert heavy_modules_after(["runtime.engines.sampling"])["torch"] is True
