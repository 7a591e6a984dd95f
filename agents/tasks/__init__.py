"""Tasks and verifiers: a registry of built-in tasks by name.

    from agents.tasks import get_task, task_names
    task = get_task("calc_arith", n_ops=3)
    problems = task.problems(8, seed=0)
    verdict = task.verify(problems[0], "<answer>42</answer>")

Built-in names (``task_names()``): the reasoning-gym generators ``basic_arithmetic``, ``chain_sum``,
``gsm_symbolic``, ``countdown`` (options = the generator's config, plus ``partial_credit``);
``calc_arith`` (calculator-tool arithmetic; ``agents.tasks.calc_arith``); ``frozenlake`` (multi-turn
gymnasium environment; ``agents.tasks.frozenlake``); ``humaneval`` (code, run in ``tools.sandbox``;
``agents.tasks.humaneval``); ``kernels`` (CUDA kernels for PyTorch reference modules, compiled, checked
and timed by ``tools.cuda``; multi-turn; ``agents.tasks.kernels.task``). Any other reasoning-gym
generator is available as ``rg:<name>``, and any single-answer task in TCPO's verifier-feedback mode
as ``feedback:<name>`` (``agents.tasks.feedback``: the verifier's score is shown between turns).
``register_task`` adds more.

Task modules are imported when a task is first built, so importing this package is cheap and pulls in
neither reasoning-gym nor gymnasium. Unknown names raise ``UnknownTask`` (a ``KeyError`` and a
``ValueError``) whose message lists the known names; bad options raise ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import Env, EnvStep, PrefixState, Problem, Task, TaskBase, Verdict

__all__ = ["Env", "EnvStep", "PrefixState", "Problem", "Task", "TaskBase", "UnknownTask", "Verdict", "get_task", "register_task", "task_names"]

TaskFactory = Callable[..., Task]
RG_PREFIX = "rg:"
FEEDBACK_PREFIX = "feedback:"


class UnknownTask(KeyError, ValueError):
    """No task is registered under this name."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(name)
        self.name = name
        self.known = known

    def __str__(self) -> str:  # KeyError would repr() the message
        return f"unknown task {self.name!r}; known tasks: {', '.join(self.known)} (and {RG_PREFIX}<any reasoning-gym generator>)"


def _reasoning_gym(dataset: str) -> TaskFactory:
    def make(**options: Any) -> Task:
        from .rgym import ReasoningGymTask

        return ReasoningGymTask(dataset, **options)

    return make


def _calc_arith(**options: Any) -> Task:
    from .calc_arith import CalcArithTask

    return CalcArithTask(**options)


def _frozenlake(**options: Any) -> Task:
    from .frozenlake import FrozenLakeTask

    return FrozenLakeTask(**options)


def _humaneval(**options: Any) -> Task:
    from .humaneval import HumanEvalTask

    return HumanEvalTask(**options)


def _kernels(**options: Any) -> Task:
    from .kernels.task import KernelTask

    return KernelTask(**options)


_REGISTRY: dict[str, TaskFactory] = {
    "basic_arithmetic": _reasoning_gym("basic_arithmetic"),
    "chain_sum": _reasoning_gym("chain_sum"),
    "gsm_symbolic": _reasoning_gym("gsm_symbolic"),
    "countdown": _reasoning_gym("countdown"),
    "calc_arith": _calc_arith,
    "frozenlake": _frozenlake,
    "humaneval": _humaneval,
    "kernels": _kernels,
}


def task_names() -> list[str]:
    """Names of the registered tasks, sorted (``rg:<generator>`` names are not listed)."""
    return sorted(_REGISTRY)


def register_task(name: str, factory: TaskFactory, *, replace: bool = False) -> None:
    """Register ``factory(**options) -> Task`` under ``name``."""
    if not name or name.startswith((RG_PREFIX, FEEDBACK_PREFIX)):
        raise ValueError(f"invalid task name {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"task {name!r} is already registered (pass replace=True to override)")
    _REGISTRY[name] = factory


def get_task(name: str, **options: Any) -> Task:
    """Build the task registered as ``name`` with ``options``; raises ``UnknownTask`` or ``ValueError``."""
    if name.startswith(FEEDBACK_PREFIX) and len(name) > len(FEEDBACK_PREFIX):
        from .feedback import VerifierFeedbackTask

        inner = name[len(FEEDBACK_PREFIX) :]
        if inner.startswith(FEEDBACK_PREFIX):
            raise ValueError(f"{name!r}: verifier feedback cannot be nested")
        return VerifierFeedbackTask(get_task(inner, **options))
    factory = _REGISTRY.get(name)
    if factory is not None:
        try:
            return factory(**options)
        except TypeError as exc:  # an option this task does not take (another task's, or a typo)
            raise ValueError(f"task {name!r} does not take these options: {exc}") from None
    if name.startswith(RG_PREFIX) and len(name) > len(RG_PREFIX):
        from .rgym import ReasoningGymTask, _import_reasoning_gym

        _import_reasoning_gym()
        from reasoning_gym.factory import DATASETS

        dataset = name[len(RG_PREFIX) :]
        if dataset not in DATASETS:
            raise UnknownTask(name, task_names())
        return ReasoningGymTask(dataset, name=name, **options)
    raise UnknownTask(name, task_names())
