"""Dependency rules from the README: light modules stay torch-free; runtime ↛ agents/memory/tools; tools ↛ project."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT_PACKAGES = {"runtime", "agents", "memory", "tools", "learner", "serve"}


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
    loaded = heavy_modules_after(["runtime.tool_parsers", "runtime.openai_schemas", "runtime.settings", "runtime.errors", "runtime.engine"])
    assert loaded == {"torch": False, "transformers": False, "xgrammar": False}


def test_other_packages_do_not_import_torch() -> None:
    loaded = heavy_modules_after(["agents", "memory", "tools", "learner"])
    assert loaded["torch"] is False
    assert loaded["transformers"] is False


def test_the_check_detects_torch() -> None:
    # the subprocess probe itself works: importing the engine module does load torch
    assert heavy_modules_after(["runtime.engines.sampling"])["torch"] is True


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(root).with_suffix("")
    package = list(rel.parts[:-1])  # for __init__.py, the package itself; otherwise the module's package
    out: set[str] = set()
    for node in ast.walk(tree):  # every import, including those inside functions
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - (node.level - 1)])
                if node.module:
                    out.add(f"{base}.{node.module}")
                else:
                    out.update(f"{base}.{a.name}" for a in node.names)
            elif node.module:
                out.add(node.module)
    return out


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_ast_scanner_sees_plain_relative_and_nested_imports(tmp_path: Path) -> None:
    mod = tmp_path / "tools" / "web" / "fetch.py"
    mod.parent.mkdir(parents=True)
    mod.write_text(
        "import json\nfrom . import util\nfrom ..base import Tool\ndef f():\n    from runtime.engine import Grammar\n    import agents.loop as al\n"
    )
    assert imported_modules(mod, tmp_path) == {"json", "tools.web.util", "tools.base", "runtime.engine", "agents.loop"}
    assert {"runtime.engine", "runtime.engines.runner", "torch", "xgrammar"} <= imported_modules(ROOT / "runtime/engines/embedded.py")


def test_runtime_never_imports_agents_memory_or_tools() -> None:
    files = sources("runtime")
    assert len(files) >= 10
    offenders = {
        str(f.relative_to(ROOT)): sorted(m for m in imported_modules(f) if m.split(".")[0] in {"agents", "memory", "tools", "serve"}) for f in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_runtime_imports_only_learner_records_from_learner() -> None:
    bad = {
        str(f.relative_to(ROOT)): m
        for f in sources("runtime")
        for m in imported_modules(f)
        if m.split(".")[0] == "learner" and not (m == "learner.records" or m.startswith("learner.records."))
    }
    assert bad == {}


def test_tools_imports_nothing_else_from_the_project() -> None:
    files = sources("tools")
    assert files, "tools has no sources"
    offenders = {str(f.relative_to(ROOT)): sorted(m for m in imported_modules(f) if m.split(".")[0] in PROJECT_PACKAGES - {"tools"}) for f in files}
    assert {k: v for k, v in offenders.items() if v} == {}
