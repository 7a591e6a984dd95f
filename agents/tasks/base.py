"""The task interface: problems, verdicts, multi-turn environments, and the ``Task`` protocol.

A ``Task`` hands out seeded problems (``problems(n, seed)`` is deterministic), checks an agent's final
answer text (``verify`` → ``Verdict``, never raising on garbage; a verdict's ``detail`` may name the gold
answer, its ``feedback`` is what a solver may be shown and never does), optionally scores single turns
(``process_score``), names the group a problem belongs to for the learner (``task_key``), and, for
multi-turn tasks, builds a text ``Env`` (``make_env``).

Two optional hooks serve the learner's rollout strategies (the runtime calls them; the learner reads the
results from the runs endpoint): ``score_prefix(problem, state) -> float in [0, 1] | None`` scores a partial
run (:class:`PrefixState`: the environment as it stands, the model's turn texts so far) for PATR's tree
rollouts; ``signature(problem) -> str | None`` names a problem's structure (operation chain, path length,
term count) so RODS's synthesis can look for other problems of the generator with the same one
(``agents/tasks/variants.py``).

``TaskBase`` is an optional convenience base class with the common defaults (no process score, no
environment, no prefix score, no signature, ``task_key = f"{name}:{problem.id}"``).

What this module does not do: it holds no task logic, no registry (see ``agents.tasks``), and does not
attach rewards to recorded trajectories (the agent loop does that with source ``verifier:<task>``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["Env", "EnvStep", "PrefixState", "Problem", "Task", "TaskBase", "Verdict"]


@dataclass(frozen=True)
class Problem:
    task: str  # task name, e.g. "basic_arithmetic"
    id: str  # stable within the task and seed, e.g. "basic_arithmetic/s0/17"
    prompt: str  # the user message text the agent gets (self-contained; says what answer format is expected)
    answer: Any  # gold answer (None if the generator has none)
    metadata: dict[str, Any]


@dataclass(frozen=True)
class Verdict:
    reward: float  # in [0, 1]
    correct: bool
    detail: str = ""  # short human-readable reason for logs and reports ("expected 42, got 41", "3/5 tests passed", ...)
    # what the solver may be shown (a feedback task's next observation): never the gold answer; "" = the score only.
    # Not part of equality: two verdicts with one reward, outcome and detail are one judgement.
    feedback: str = field(default="", compare=False)

    def shown(self) -> Verdict:
        """This verdict with its ``detail`` as its ``feedback``: for tasks whose details never name the answer."""
        return dataclasses.replace(self, feedback=self.detail)

    def __post_init__(self) -> None:
        if not (isinstance(self.reward, int | float) and math.isfinite(self.reward) and 0.0 <= self.reward <= 1.0):
            raise ValueError(f"Verdict.reward must be a finite number in [0, 1], got {self.reward!r}")


@dataclass(frozen=True)
class EnvStep:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefixState:
    """A partial run as a process scorer sees it: the environment in its current state (None for tasks without
    one), the model's turn texts so far (replayed turns included) and whether the run has ended."""

    env: Any
    turns: tuple[str, ...]
    done: bool = False


@runtime_checkable
class Env(Protocol):
    """A multi-turn text environment (e.g. FrozenLake).

    Optionally an environment also has ``state_key() -> str | None``: its current state without the history
    (e.g. FrozenLake's cell), recorded before each turn as the trajectory's meta ``state_keys`` so the learner's
    GiGPO compares the actions taken in one state across trajectories, whatever path led there (GiGPO's anchor
    state; the exact context would differ after the first turn). ``None``, or no such method: no state key.
    """

    def reset(self) -> str:
        """Start (or restart) the episode; returns the first observation text."""
        ...

    def step(self, action_text: str) -> EnvStep:
        """Parse the model's action from free text and apply it. Unparsable text gives an observation explaining the format,
        a zero reward, and ``done=False`` (environments may end an episode after repeated format errors)."""
        ...


@runtime_checkable
class Task(Protocol):
    name: str
    description: str
    tools: tuple[str, ...]  # tool names the task expects the agent to have (e.g. ("calculator",)); () if none

    def problems(self, n: int, seed: int = 0) -> list[Problem]:
        """``n`` problems, deterministic for ``(n, seed)``."""
        ...

    def verify(self, problem: Problem, answer: str) -> Verdict:
        """Check the agent's final answer text (may be a whole message); never raises on garbage."""
        ...

    def process_score(self, problem: Problem, turn_text: str) -> float | None:
        """Optional per-turn process score in [0, 1]; None if the task has none."""
        ...

    def task_key(self, problem: Problem) -> str:
        """Grouping key for the learner (same problem → same key)."""
        ...

    def make_env(self, problem: Problem) -> Env | None:
        """A fresh environment for a multi-turn problem; None for single-answer tasks."""
        ...


class TaskBase:
    """Defaults shared by the built-in tasks; subclasses set ``name``/``description``/``tools`` and implement ``problems``/``verify``."""

    name: str = ""
    description: str = ""
    tools: tuple[str, ...] = ()

    def problems(self, n: int, seed: int = 0) -> list[Problem]:
        raise NotImplementedError

    def verify(self, problem: Problem, answer: str) -> Verdict:
        raise NotImplementedError

    def process_score(self, problem: Problem, turn_text: str) -> float | None:
        return None

    def task_key(self, problem: Problem) -> str:
        return f"{self.name}:{problem.id}"

    def make_env(self, problem: Problem) -> Env | None:
        return None

    def score_prefix(self, problem: Problem, state: PrefixState) -> float | None:
        """PATR's process scorer: how promising a partial run is, in [0, 1]; None = this task has none."""
        return None

    def signature(self, problem: Problem) -> str | None:
        """The problem's structure for RODS's variants (same signature = same shape, other values); None = any problem."""
        return None

    def _check_n(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{self.name}: n must be a non-negative integer, got {n!r}")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
