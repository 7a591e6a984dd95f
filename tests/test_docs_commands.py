"""The commands the README and ``docs/*.md`` show are real: checked without running anything.

Commands are read from fenced ``bash``/``sh``/``shell``/``console`` blocks (comments dropped, ``\\`` continuations
joined), from the whole-line comments of ``toml``/``json``/``ini`` blocks (``# serve.py --learner-config svr.toml``),
from the prose's inline code spans, and from the first column of a ``| flag | default | meaning |`` table. For each:

- ``serve.py`` / ``loopwise serve``: every ``--flag`` is one of ``serve.build_parser()``'s (generated from the settings);
- ``python -m learner <sub>`` / ``loopwise learner <sub>`` / ``loopwise export``: ``<sub>`` is a subcommand of
  ``learner.__main__.build_parser()`` and every flag one of that subcommand's;
- ``loopwise <command>``: a command of the console script (``serve.COMMANDS``);
- ``python -m <module>`` of this project (``learner.leap``, ``experiments.*``, ...) and ``bench/<script>``: the file
  exists and every flag is one its ``add_argument`` calls declare, read from its source together with the argument
  helpers it imports from the project (nothing is imported or run);
- ``make <target>``: a target of the Makefile; ``pytest -m <expr>``: registered markers; ``pip install '.[x]'``: extras
  the project declares.

Other programs (``curl``, ``python -m sglang.launch_server``, ...) are not checked. Flags must be spelled in full:
argparse accepts a prefix, the docs should not rely on it.
"""

from __future__ import annotations

import argparse
import ast
import functools
import itertools
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SHELL = {"bash", "sh", "shell", "console"}
CONFIG = {"toml", "json", "ini"}
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
CMD = re.compile(
    r"""(?x) (?<![\w./-]) (?:
        (?:\S*python3?\s+)? (?P<serve>serve\.py) (?![\w.])
      | (?:\S*python3? | torchrun\b[^|;&]*?) \s+ -m \s+ (?P<module>[\w.]+)
      | loopwise \s+ (?P<loopwise>[a-z][\w-]*) (?![\w:.@-])
      | (?P<make>make) (?=\s+\w)
      | (?:\S*python3?\s+)? (?P<bench>bench/[\w/.-]*\.(?:py|sh)) (?![\w.])
      | (?P<pytest>pytest) (?![\w.-])
      | pip \s+ install \s+ (?:-\S+\s+)* ['"]? \.\[ (?P<extras>[^\]]+) \]
    )"""
)


@dataclass(frozen=True)
class Command:
    kind: str  # serve | module | loopwise | make | bench | pytest | extras (the CMD group that matched)
    name: str  # what that group matched: the script, module, console command or extras
    rest: str  # the text after it: flags, subcommands, targets
    text: str  # the snippet, for the report


def snippets(markdown: str) -> Iterator[str]:
    """The text commands are written in: shell lines, config-comment lines, inline code spans."""
    for block in FENCE.finditer(markdown):
        lang, body = block.group(1).lower(), block.group(2)
        if lang in SHELL:
            for line in re.sub(r"\\\n", " ", body).splitlines():
                yield re.sub(r"(?:^|\s)#.*", "", re.sub(r"^\s*\$\s", "", line))
        elif lang in CONFIG:
            yield from re.findall(r"^\s*#(.*)$", body, re.M)
    yield from SPAN.findall(FENCE.sub("", markdown))


def flag_table(markdown: str) -> Iterator[Command]:
    """The first column of a ``| flag | default | meaning |`` table: ``serve.py``'s flags."""
    lines = markdown.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\|\s*flag\s*\|", line):
            for row in itertools.takewhile(lambda r: r.startswith("|"), lines[i + 2 :]):
                yield Command("serve", "serve.py", " ".join(SPAN.findall(row.split("|")[1])), row)


def commands(markdown: str) -> Iterator[Command]:
    for snippet in snippets(markdown):
        for segment in re.split(r"\s(?:&&|\|\||\||;)\s", snippet):
            if m := CMD.search(segment):
                kind = next(k for k, v in m.groupdict().items() if v is not None)
                yield Command(kind, m.group(kind), segment[m.end() :], " ".join(segment.split()))
    yield from flag_table(markdown)


# what the commands may say


def option_strings(parser: argparse.ArgumentParser) -> frozenset[str]:
    return frozenset(o for action in parser._actions for o in action.option_strings)


@functools.cache
def serve_module() -> Any:
    import serve

    return serve


@functools.cache
def serve_flags() -> frozenset[str]:
    return option_strings(serve_module().build_parser())


@functools.cache
def learner_subcommands() -> dict[str, frozenset[str]]:
    from learner.__main__ import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: option_strings(parser) for name, parser in sub.choices.items()}


@functools.cache
def make_targets() -> frozenset[str]:
    return frozenset(re.findall(r"^([\w.-]+)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M))


@functools.cache
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def module_file(module: str, package: bool = False) -> Path | None:
    """The project's source of ``module`` (``python -m`` runs a package's ``__main__``; an import reads its ``__init__``)."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / ("__init__.py" if package else "__main__.py")):
        if path.is_file():
            return path
    return None


@functools.cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def argument_flags(tree: ast.AST) -> set[str]:
    """The option strings of the ``add_argument`` calls under ``tree`` (``--no-x`` too for BooleanOptionalAction)."""
    flags: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-")]
            flags.update(names)
            if any(k.arg == "action" and "BooleanOptionalAction" in ast.unparse(k.value) for k in node.keywords):
                flags.update("--no-" + n[2:] for n in names if n.startswith("--"))
    return flags


@functools.cache
def declared_flags(path: Path) -> frozenset[str]:
    """A script's flags, from its source: its own ``add_argument`` calls and those of the project functions it imports."""
    tree = parse(path)
    flags = {"-h", "--help", *argument_flags(tree)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level and (source := module_file(node.module, package=True)):
            defs = {d.name: d for d in ast.walk(parse(source)) if isinstance(d, ast.FunctionDef)}
            flags.update(f for alias in node.names if alias.name in defs for f in argument_flags(defs[alias.name]))
    return frozenset(flags)


# the checks


def unknown_flags(rest: str, known: frozenset[str]) -> list[str]:
    return [f"unknown flag {flag}" for flag in FLAG.findall(QUOTED.sub(" ", rest)) if flag not in known]


def check_learner(rest: str, sub: str | None) -> list[str]:
    subs = learner_subcommands()
    if sub is None:
        m = re.match(r"\s*([\w|]+)", rest)
        if m is None:
            return unknown_flags(rest, frozenset({"-h", "--help"}))
        names, rest = m.group(1).split("|"), rest[m.end() :]
    else:
        names = [sub]
    missing = [f"no learner subcommand {n!r}" for n in names if n not in subs]
    return missing or [p for n in names for p in unknown_flags(rest, subs[n])]


def check_markers(rest: str) -> list[str]:
    m = re.search(r"(?:^|\s)-m\s+('[^']*'|\"[^\"]*\"|\S+)", rest)
    if m is None:
        return []
    markers = {line.split(":")[0].strip() for line in pyproject()["tool"]["pytest"]["ini_options"]["markers"]}
    named = set(re.findall(r"[A-Za-z_]\w*", m.group(1))) - {"and", "or", "not"}
    return [f"no pytest marker {n!r}" for n in sorted(named - markers)]


def check_module(module: str, rest: str) -> list[str]:
    if module == "pytest":
        return check_markers(rest)
    if module == "learner":
        return check_learner(rest, None)
    top = module.split(".")[0]
    if not (ROOT / top).is_dir() and not (ROOT / f"{top}.py").is_file():
        return []  # another program's module (sglang, vllm, ...)
    path = module_file(module)
    return [f"no module {module}"] if path is None else unknown_flags(rest, declared_flags(path))


def check(c: Command) -> list[str]:
    if c.kind == "serve":
        return unknown_flags(c.rest, serve_flags())
    if c.kind == "module":
        return check_module(c.name, c.rest)
    if c.kind == "loopwise":
        scripts = serve_module().COMMANDS
        if c.name not in scripts:
            return [f"no loopwise command {c.name!r}"]
        target, prefix, _ = scripts[c.name]
        module = target.partition(":")[0]
        if module == "serve":
            return unknown_flags(c.rest, serve_flags())
        if module == "learner.__main__":
            return check_learner(c.rest, prefix[0] if prefix else None)
        return check_module(module, c.rest)
    if c.kind == "bench":
        path = ROOT / c.name
        if not path.is_file():
            return [f"no script {c.name}"]
        return unknown_flags(c.rest, declared_flags(path)) if path.suffix == ".py" else []
    if c.kind == "make":
        targets = []
        for word in c.rest.split():
            if "=" in word or word.startswith("-"):
                continue  # VAR=value, make's own options
            if not re.fullmatch(r"[\w.-]+", word):
                break
            targets.append(word)
        return [f"no make target {t!r}" for t in targets if t not in make_targets()]
    if c.kind == "pytest":
        return check_markers(c.rest)
    if c.kind == "extras":
        extras = pyproject()["project"]["optional-dependencies"]
        return [f"no extra {e.strip()!r}" for e in c.name.split(",") if e.strip() not in extras]
    raise AssertionError(c.kind)


def problems(markdown: str) -> list[tuple[str, str]]:
    """(snippet, what is wrong with it) for every command of ``markdown`` that is not real."""
    return [(c.text, issue) for c in commands(markdown) for issue in check(c)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_commands_in_the_docs_are_real(doc: Path) -> None:
    found = problems(doc.read_text())
    assert found == [], f"{doc.name}:\n" + "\n".join(f"  `{text}`: {issue}" for text, issue in found)


def test_the_readme_opens_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    first = FENCE.search(readme)
    assert first is not None and first.group(1) == "bash"
    assert readme.index(first.group(0)) < readme.index("\n## ")  # before any section
    assert [c.text for c in commands(first.group(0))] == ["make serve", "make test"]


def test_the_docs_commands_are_found() -> None:
    """The extraction sees the commands the docs show (a pattern that matched nothing would pass every page)."""
    found = [c for doc in DOCS for c in commands(doc.read_text())]
    assert {"serve", "module", "loopwise", "make", "bench", "pytest", "extras"} <= {c.kind for c in found}
    serve_flags_shown = {f for c in found if c.kind == "serve" for f in FLAG.findall(c.rest)}
    assert {"--model", "--backend", "--store", "--no-learner", "--vllm-launch", "--learner-config", "--api-key"} <= serve_flags_shown
    assert {c.name for c in found if c.kind == "module"} >= {"learner", "learner.leap", "experiments.memory_train"}


MADE_UP = """
```bash
python serve.py --model tiny --no-such-flag   # a comment: --not-checked
python -m learner run --base-model M --family f --nope
python -m learner frobnicate
loopwise frobnicate
loopwise export --format jsonl --bogus-export
make serve no-such-target
.venv/bin/python bench/serving.py --peers none --not-a-bench-flag
bench/no_such_script.py
pytest -m 'slow and not no_such_marker'
pip install -e '.[no_such_extra]'
python -m sglang.launch_server --anything-goes
```

```toml
# serve.py --learner-config x.toml --no-such-config-flag
```

In prose: `python -m experiments.memory_train --spawn --bogus-train` and `python -m experiments.no_such_module`.

| flag | default | meaning |
|---|---|---|
| `--port` / `--no-such-table-flag` | 1 | x |
"""


def test_made_up_commands_are_reported() -> None:
    issues = [issue for _, issue in problems(MADE_UP)]
    expected = [
        "unknown flag --no-such-flag",
        "unknown flag --nope",
        "no learner subcommand 'frobnicate'",
        "no loopwise command 'frobnicate'",
        "unknown flag --bogus-export",
        "no make target 'no-such-target'",
        "unknown flag --not-a-bench-flag",
        "no script bench/no_such_script.py",
        "no pytest marker 'no_such_marker'",
        "no extra 'no_such_extra'",
        "unknown flag --no-such-config-flag",
        "unknown flag --bogus-train",  # --spawn comes from the helper memory_train imports: accepted
        "no module experiments.no_such_module",
        "unknown flag --no-such-table-flag",
    ]
    assert sorted(issues) == sorted(expected)
