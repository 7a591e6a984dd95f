"""LEAP's difficulty-conditioned pruning (DCP) of probed kernel tasks: which tasks multi-turn expansion is spent on.

    from learner.leap_dcp import ProbeSample, classify_probe, prune
    report = prune({"level1/relu": [ProbeSample(...), ...], ...}, max_turns=4)
    report.kept, report.pruned, report.fraction_pruned, report.compile_calls_saved

DCP (our reading of LEAP's abstract: ``docs/methods.md``). Before multi-turn expansion, each task gets ``G``
cheap first-turn samples (the *probe*). :func:`classify_probe` labels the task from them:

* ``simple``: the share correct ``p >= p_hi`` (default 1.0: all correct) and the median speedup among the
  correct ones ``>= s_hi`` (default 1.0x): refinement turns have nothing to fix;
* ``catastrophic``: nothing correct and every sample failed *the same way* at compile or run time: the
  same failure class (no code, compile timeout, compile error, runtime error) and, for compile errors,
  the same first error message (line numbers ignored): refinement would spend its compile calls on one
  wall. Kernels that compiled and ran but gave wrong output are never catastrophic (the checker's
  feedback is exactly what refinement turns work from);
* ``useful`` otherwise: expanded into ``max_turns``-turn refinement trajectories.

Compile-only mode. On a machine that cannot run kernels (no GPU) no probe sample has correctness or speed
(``measured`` is false for every compiled sample), so the decision uses compile outcomes only, and the
report says so: ``simple`` = every sample compiled (the only feedback such a machine gives, compiler
diagnostics, has nothing left to fix); ``catastrophic`` = no sample compiled and all share one first
error (or all are format errors / compile timeouts); ``useful`` otherwise. This is a weaker reading than
the GPU one: "all compiled" is not "all correct".

:func:`prune` applies the rule to every task, logs the fraction pruned (``leap.dcp`` event) and counts the
compile budget: unpruned expansion spends ``G * (max_turns - 1)`` further compile calls per task (each of
the G probes refined for the remaining turns); every pruned task saves all of them. :func:`load_probe` reads a
recorded probe (JSON lines).

What it does not do: sample, compile or run kernels (the probe is recorded elsewhere, e.g.
``bench/leap_probe.py``, or probed on a running server by ``learner.leap_expand``), decide how a ``simple`` task
is trained (single-turn group or skipped: the caller's choice), or the command line (``python -m learner.leap``,
``learner/leap.py``). Of the project it imports only ``tools.cuda.api``'s failure classes.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import structlog

from tools.cuda.api import failure_class

__all__ = ["ProbeClass", "ProbeSample", "PruneReport", "classify_probe", "explain_probe", "load_probe", "prune"]

log = structlog.get_logger(__name__)

_LINE_RE = re.compile(r"\bline \d+\b|\(\d+\)|:\d+(?::\d+)?:")
_WS_RE = re.compile(r"\s+")


class ProbeClass(StrEnum):
    SIMPLE = "simple"
    CATASTROPHIC = "catastrophic"
    USEFUL = "useful"


@dataclass(frozen=True)
class ProbeSample:
    """One first-turn candidate of a task, as the kernel tools judged it."""

    task: str
    found_code: bool = True
    compiled: bool = False
    compile_timed_out: bool = False
    first_error: str | None = None  # the first compiler error ("line 12: error: ...")
    measured: bool = False  # the kernel ran on a GPU against the reference
    correct: bool | None = None  # None when not measured
    speedup: float | None = None  # eager_ms / kernel_ms for a correct kernel
    n_tokens: int = 0

    @property
    def failure_class(self) -> str | None:
        """None for a correct kernel; else format / compile_timeout / compile_error / unmeasured / runtime_error / incorrect."""
        return failure_class(
            found_code=self.found_code, compile_timed_out=self.compile_timed_out, compiled=self.compiled, measured=self.measured, correct=self.correct
        )

    @property
    def failure_key(self) -> str | None:
        """What "failed the same way" compares: the class, plus the first error (line numbers dropped) for compile errors."""
        cls = self.failure_class
        if cls != "compile_error":
            return cls
        msg = _WS_RE.sub(" ", _LINE_RE.sub("", self.first_error or "")).strip().lower()
        return f"compile_error:{msg}"

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> ProbeSample:
        speed = row.get("speedup")
        return cls(
            task=str(row["task"]),
            found_code=bool(row.get("found_code", True)),
            compiled=bool(row.get("compiled", False)),
            compile_timed_out=bool(row.get("compile_timed_out", False)),
            first_error=row.get("first_error"),
            measured=bool(row.get("measured", False)),
            correct=None if row.get("correct") is None else bool(row["correct"]),
            speedup=None if speed is None else float(speed),
            n_tokens=int(row.get("n_tokens") or 0),
        )


def _compile_only(results: Sequence[ProbeSample]) -> bool:
    """No compiled sample was measured: the machine cannot run kernels (or nothing compiled, which needs no run)."""
    return not any(r.measured for r in results if r.compiled)


def explain_probe(results: Sequence[ProbeSample], *, p_hi: float = 1.0, s_hi: float = 1.0) -> tuple[ProbeClass, str]:
    """:func:`classify_probe` with the reason in words."""
    g = len(results)
    if g == 0:
        raise ValueError("a probe needs at least one sample")
    if not 0.0 < p_hi <= 1.0 or s_hi <= 0.0:
        raise ValueError(f"need 0 < p_hi <= 1 and s_hi > 0, got p_hi={p_hi}, s_hi={s_hi}")
    keys = {r.failure_key for r in results}
    n_compiled = sum(r.compiled for r in results)
    if _compile_only(results):
        if n_compiled == g:
            return ProbeClass.SIMPLE, f"all {g} compiled (compile-only: correctness and speed not measured on this machine)"
        if n_compiled == 0 and len(keys) == 1:
            return ProbeClass.CATASTROPHIC, f"all {g} failed the same way: {next(iter(keys))}"
        return ProbeClass.USEFUL, f"{n_compiled}/{g} compiled (compile-only: correctness and speed not measured on this machine)"
    correct = [r for r in results if r.failure_class is None]
    p = len(correct) / g
    if correct and p >= p_hi:
        speeds = [r.speedup for r in correct if r.speedup is not None and math.isfinite(r.speedup)]
        s_med = statistics.median(speeds) if speeds else None
        if s_med is not None and s_med >= s_hi:
            return ProbeClass.SIMPLE, f"{len(correct)}/{g} correct, median speedup {s_med:.2f}x >= {s_hi:g}x"
        shown = "unmeasured" if s_med is None else f"{s_med:.2f}x"
        return ProbeClass.USEFUL, f"{len(correct)}/{g} correct but median speedup {shown} < {s_hi:g}x: room to speed up"
    if not correct and len(keys) == 1 and _hard_failure(next(iter(keys))):
        return ProbeClass.CATASTROPHIC, f"all {g} failed the same way: {next(iter(keys))}"
    return ProbeClass.USEFUL, f"{len(correct)}/{g} correct, {len(keys - {None})} distinct failure kinds"


def _hard_failure(key: str | None) -> bool:
    """A failure refinement turns cannot get past by feedback alone: no code, a compile timeout or error, a runtime error.
    Kernels that compiled and ran but were wrong are not catastrophic: the checker's feedback is what the turns use."""
    return key is not None and (key in ("format", "compile_timeout", "runtime_error") or key.startswith("compile_error"))


def classify_probe(results: Sequence[ProbeSample], *, p_hi: float = 1.0, s_hi: float = 1.0) -> ProbeClass:
    """``simple`` / ``catastrophic`` / ``useful`` for one task's G first-turn samples (see the module docstring)."""
    return explain_probe(results, p_hi=p_hi, s_hi=s_hi)[0]


@dataclass(frozen=True)
class PruneReport:
    kept: list[str]  # tasks to expand, in input order
    pruned: dict[str, tuple[str, str]]  # task -> (class, reason)
    classes: dict[str, str]  # every task -> its class
    reasons: dict[str, str]
    group_sizes: dict[str, int]
    max_turns: int
    compile_only: bool  # no compiled probe sample was measured: decisions used compile outcomes only
    compile_calls_unpruned: int  # sum over all tasks of G * (max_turns - 1)
    compile_calls_saved: int  # sum over pruned tasks of G * (max_turns - 1)
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def n_tasks(self) -> int:
        return len(self.classes)

    @property
    def fraction_pruned(self) -> float:
        return len(self.pruned) / self.n_tasks if self.n_tasks else 0.0

    @property
    def fraction_budget_saved(self) -> float:
        return self.compile_calls_saved / self.compile_calls_unpruned if self.compile_calls_unpruned else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_tasks": self.n_tasks,
            "counts": self.counts,
            "fraction_pruned": self.fraction_pruned,
            "max_turns": self.max_turns,
            "compile_only": self.compile_only,
            "compile_calls_unpruned": self.compile_calls_unpruned,
            "compile_calls_saved": self.compile_calls_saved,
            "fraction_budget_saved": self.fraction_budget_saved,
            "kept": self.kept,
            "pruned": {k: {"class": c, "reason": r} for k, (c, r) in self.pruned.items()},
        }

    def format(self) -> str:
        mode = "compile-only (no GPU: correctness and speed not measured)" if self.compile_only else "measured (compile, correctness, speed)"
        lines = [
            f"DCP over {self.n_tasks} tasks, mode: {mode}",
            "classes: " + ", ".join(f"{k} {self.counts.get(k, 0)}" for k in ("simple", "catastrophic", "useful")),
            f"pruned: {len(self.pruned)}/{self.n_tasks} = {self.fraction_pruned:.1%}",
            f"compile calls for {self.max_turns}-turn expansion: unpruned {self.compile_calls_unpruned}, saved {self.compile_calls_saved} "
            f"({self.fraction_budget_saved:.1%})",
            "",
        ]
        width = max((len(t) for t in self.classes), default=4)
        for task, cls in self.classes.items():
            lines.append(f"  {task:<{width}}  {cls:<12}  G={self.group_sizes[task]}  {self.reasons[task]}")
        return "\n".join(lines)


def prune(tasks_probes: Mapping[str, Sequence[ProbeSample]], *, max_turns: int = 4, p_hi: float = 1.0, s_hi: float = 1.0) -> PruneReport:
    """Classify every task's probe; keep the useful ones. Logs ``leap.dcp`` with the fraction pruned."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    classes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    sizes: dict[str, int] = {}
    kept: list[str] = []
    pruned: dict[str, tuple[str, str]] = {}
    unpruned = saved = 0
    compile_only = True
    for task, results in tasks_probes.items():
        cls, why = explain_probe(results, p_hi=p_hi, s_hi=s_hi)
        classes[task], reasons[task], sizes[task] = str(cls), why, len(results)
        compile_only = compile_only and _compile_only(results)
        calls = len(results) * (max_turns - 1)
        unpruned += calls
        if cls is ProbeClass.USEFUL:
            kept.append(task)
        else:
            pruned[task] = (str(cls), why)
            saved += calls
    counts = {str(c): sum(v == c for v in classes.values()) for c in ProbeClass}
    report = PruneReport(kept, pruned, classes, reasons, sizes, max_turns, compile_only, unpruned, saved, counts)
    log.info(
        "leap.dcp",
        tasks=report.n_tasks,
        pruned=len(pruned),
        fraction_pruned=round(report.fraction_pruned, 4),
        compile_calls_saved=saved,
        compile_calls_unpruned=unpruned,
        compile_only=compile_only,
        **counts,
    )
    return report


def load_probe(path: str | Path) -> dict[str, list[ProbeSample]]:
    """A recorded probe (JSON lines; lines with a ``meta`` key and blank lines are skipped), grouped by task in file order.

    Only turn-0 rows count (a row without ``turn`` is turn 0)."""
    out: dict[str, list[ProbeSample]] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from exc
        if "meta" in row:
            continue
        if "task" not in row:
            raise ValueError(f"{path}:{n}: a probe row needs a 'task'")
        if int(row.get("turn", 0)) != 0:
            continue
        out.setdefault(str(row["task"]), []).append(ProbeSample.from_dict(row))
    return out
