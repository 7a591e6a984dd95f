"""The layering of docs/architecture.md, checked over every real module's imports (AST, nothing imported).

What each library package may import from the project:

- ``learner.records`` (the neutral floor: the record types, the adapter manifest, the interaction store on SQLite and
  PostgreSQL, the experiments and adapter-registry tables) → nothing else of the project, and no torch
- ``runtime`` → ``learner.records``
- ``tools`` → nothing
- ``memory`` → the runtime's client protocol, ``learner.records``
- ``agents`` → the runtime's client protocol, ``tools``, ``memory``, ``learner.records``
- ``learner`` → ``tools`` (it reaches the runtime only over its admin API, agents' tasks over the runs endpoint)

``serve.py`` (the composition root) with ``loopwise_settings.py`` (its root settings model), ``experiments/`` and
``bench/`` may import anything; no library package imports them. Imports inside functions count the same as those at
the top. The packages' settings modules that the root settings embed (``learner.config``, ``agents.settings``,
``memory.settings``) import nothing from the project, pydantic and the standard library only.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("runtime", "tools", "memory", "agents", "learner")
DRIVERS = ("serve", "loopwise_settings", "experiments", "bench", "tests")  # may import anything; nothing in LIBRARY imports them
PROJECT = {*LIBRARY, *DRIVERS}
RUNTIME_CLIENT = ("runtime.agent_api", "runtime.engine", "runtime.identity")  # what agents and memory call the runtime through
RECORDS = ("learner.records",)  # the floor both sides share: records, the adapter manifest, the stores, their tables
SETTINGS_MODULES = ("learner.config", "agents.settings", "memory.settings")  # what the root settings embed (pydantic only)

MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "runtime": RECORDS,
    "tools": (),
    "memory": (*RUNTIME_CLIENT, *RECORDS),
    "agents": (*RUNTIME_CLIENT, *RECORDS, "tools", "memory"),
    "learner": ("tools",),
}


def _is_module(dotted: str, root: Path) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Absolute names of what ``path`` imports: ``from pkg import mod`` names ``pkg.mod`` where that is a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(root).with_suffix("")
    package = list(rel.parts[:-1])
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = ".".join(package[: len(package) - (node.level - 1)])
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if _is_module(sub, root) else base)
    return out


def allowed(package: str, module: str) -> bool:
    top = module.split(".")[0]
    if top not in PROJECT or top == package:
        return True
    return any(module == a or module.startswith(a + ".") for a in MAY_IMPORT[package])


def violations(root: Path = ROOT) -> set[tuple[str, str]]:
    found = set()
    for package in LIBRARY:
        for path in sorted((root / package).rglob("*.py")):
            found |= {(str(path.relative_to(root)), m) for m in imported_modules(path, root) if not allowed(package, m)}
    return found


def test_the_scanner_resolves_from_imports_and_sees_nested_ones(tmp_path: Path) -> None:
    pkg = tmp_path / "memory"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "util.py").write_text("")
    (tmp_path / "learner").mkdir()
    (tmp_path / "learner" / "__init__.py").write_text("")
    (tmp_path / "learner" / "store.py").write_text("")
    (pkg / "mod.py").write_text(
        "from learner import store as s\nfrom . import util\nfrom .util import thing\n"
        "def f():\n    import experiments.memory_train\n    from runtime.engine import Grammar\n"
    )
    assert imported_modules(pkg / "mod.py", tmp_path) == {"learner.store", "memory.util", "experiments.memory_train", "runtime.engine"}


@pytest.mark.parametrize(
    ("package", "module", "ok"),
    [
        ("runtime", "learner.records", True),
        ("runtime", "learner.records.store", True),
        ("runtime", "learner.records.adapter_manifest", True),
        ("runtime", "learner.samples", False),
        ("runtime", "learner.publish", False),
        ("runtime", "agents.loop", False),
        ("runtime", "agents.settings", False),
        ("runtime", "agents.config", False),
        ("runtime", "memory.settings", False),
        ("runtime", "memory.config", False),
        ("runtime", "learner.config", False),
        ("runtime", "loopwise_settings", False),
        ("runtime", "serve", False),
        ("tools", "runtime.engine", False),
        ("memory", "runtime.agent_api", True),
        ("memory", "runtime.app", False),
        ("memory", "learner.trainer", False),
        ("agents", "memory.store", True),
        ("agents", "experiments.agent_eval", False),
        ("learner", "tools.cuda.api", True),
        ("learner", "agents.tasks", False),
        ("learner", "runtime.adapters.validation", False),
        ("learner", "learner.records.experiments_store", True),
        ("learner", "runtime.adapters.experiments", False),
        ("learner", "runtime.experiments_store", False),
        ("memory", "learner.records.store", True),
        ("memory", "learner.store", False),
        ("learner", "torch", True),
    ],
)
def test_the_rules(package: str, module: str, ok: bool) -> None:
    assert allowed(package, module) is ok


FLOOR = "learner.records"
HEAVY = ("torch", "transformers", "peft", "numpy")


def floor_violations(root: Path = ROOT) -> set[tuple[str, str]]:
    """Imports of the floor's modules beyond itself and the third-party packages it may use (no torch, no other project code)."""
    found = set()
    for path in sorted(root.joinpath(*FLOOR.split(".")).rglob("*.py")):
        for m in imported_modules(path, root):
            top = m.split(".")[0]
            if (top in PROJECT and not (m == FLOOR or m.startswith(FLOOR + "."))) or top in HEAVY:
                found.add((str(path.relative_to(root)), m))
    return found


def test_the_floor_imports_nothing_else_of_the_project_and_no_torch() -> None:
    assert floor_violations() == set()


def test_the_floor_check_sees_a_violation(tmp_path: Path) -> None:
    (tmp_path / "learner" / "records").mkdir(parents=True)
    (tmp_path / "learner" / "__init__.py").write_text("")
    (tmp_path / "learner" / "samples.py").write_text("")
    (tmp_path / "learner" / "records" / "__init__.py").write_text("import json\n")
    (tmp_path / "learner" / "records" / "store.py").write_text("from learner.samples import Sample\nimport torch\nfrom learner.records import Turn\n")
    assert floor_violations(tmp_path) == {("learner/records/store.py", "learner.samples"), ("learner/records/store.py", "torch")}


def test_library_packages_keep_the_layering() -> None:
    assert violations() == set(), "imports that break the layering (docs/architecture.md)"


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    for package in LIBRARY:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "learner" / "leap_expand.py").write_text("from agents.tasks import get_task\n")
    (tmp_path / "agents" / "tasks.py").write_text("")
    assert violations(tmp_path) == {("learner/leap_expand.py", "agents.tasks")}


def foreign_imports(module: str, root: Path = ROOT) -> set[str]:
    """What a settings module imports beyond pydantic and the standard library (the project's modules included)."""
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    return {m for m in imported_modules(path, root) if m.split(".")[0] not in {*sys.stdlib_module_names, "pydantic"}}


@pytest.mark.parametrize("module", SETTINGS_MODULES)
def test_the_settings_modules_the_root_settings_embed_are_pydantic_only(module: str) -> None:
    """``serve.py`` imports these (through the root settings) to parse its flags before any heavy import: a settings
    module that imported its package's code (or another package) would bring that into every start, ``--help`` included."""
    assert foreign_imports(module) == set()


def test_the_settings_check_sees_a_project_import(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "store.py").write_text("")
    (tmp_path / "memory" / "settings.py").write_text("import json\nfrom pydantic import BaseModel\nfrom memory.store import MemoryStore\n")
    assert foreign_imports("memory.settings", tmp_path) == {"memory.store"}
