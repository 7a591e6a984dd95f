"""``kernels``: write a CUDA kernel for a PyTorch reference module; compile, check and time it, over several turns.

    task = get_task("kernels", level=1, reward="kevin", max_turns=4)
    problem = task.problems(8, seed=0)[0]        # prompt: the reference module, the source convention, the format
    env = task.make_env(problem); env.reset()
    step = env.step(model_text)                   # compile -> check -> bench; step.observation is the feedback

Problems come from ``agents.tasks.kernels.kernel_tasks(level)``: seed 0 keeps the (level, name) order, any
other seed is a seeded shuffle; ``n`` above the task count gives them all. The gold answer is the task's
known-good solution (never shown to the model).

Each step takes the CUDA source from the model's text (the last fenced block tagged ``cuda``, ``cu``,
``cpp``, ``c++`` or ``cxx``; an untagged block only if it looks like CUDA C++), then runs ``tools.cuda``:
``cuda_compile``; if it compiled, ``cuda_check`` against the reference module; if that was measured and
correct, ``cuda_bench``. The observation is the compiler's diagnostics (first errors with their lines) or
the check / bench results. The episode ends when a kernel is correct and benchmarked, after ``max_turns``
steps, or, on a machine where correctness cannot be measured (no GPU), as soon as a kernel compiles: the
tools can tell nothing more, so further turns would only repeat "not measured on this machine". A reply
without a code block is a format error: it uses a turn and gets an explanation.

Rewards use only what was measured, and only the terminal step carries one (non-terminal steps give 0,
so the loop's sum is the episode reward):

* ``reward="kevin"`` (Kevin, Baronio et al. 2025): ``0.3 * correct + speedup * correct``, where correct
  and speedup come from ``cuda_check`` / ``cuda_bench``. Compile success alone earns nothing: on a
  machine without a GPU every episode's reward is 0. ``Verdict`` and the agent loop take rewards in
  [0, 1], so the reward returned is capped at 1.0; the uncapped value is ``info["kevin_reward"]`` (and in
  the verdict detail), and ``info["reward"]``, which the agent loop records as the trajectory's reward.
* ``reward="rank"`` (LEAP, our reading: ``docs/methods.md``): the episode reward, and ``info["reward"]`` the loop
  records, is 1.0 when correct, else 0.0; the tournament inside a group (correct beats incorrect, faster
  beats slower, fewer tokens breaks ties between correct kernels) is computed by the learner's ``rank``
  estimator from the recorded meta ``correct``, ``score`` (``info["score"]``: Kevin's value, monotone in
  speedup) and the token counts.

``info["correct"]`` is None when correctness was not measured (no GPU): the loop records it as unknown,
not as incorrect, so the rank estimator leaves such runs out instead of ranking them by length.

``verify(problem, answer)`` runs the same pipeline once on the final answer text.

What it does not do: compile or run anything itself (``tools.cuda`` owns nvcc, the extension build, the
sandboxed process and the timeouts), profile kernels, or give partial credit for a kernel that compiles.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import structlog

from tools.cuda.api import failure_class

from ..base import EnvStep, Problem, TaskBase, Verdict
from . import CONVENTION, KernelTaskSpec, get_kernel_task, kernel_tasks

__all__ = ["KernelEnv", "KernelOutcome", "KernelTask", "KernelToolset", "evaluate_candidate", "extract_cuda", "kevin_reward"]

log = structlog.get_logger(__name__)

_FENCE_RE = re.compile(r"```[ \t]*([\w+#-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_CUDA_TAGS = ("cuda", "cu", "cpp", "c++", "cxx", "cc")
_LOOKS_CUDA_RE = re.compile(r"__global__|PYBIND11_MODULE|torch/extension\.h")
_MAX_ANSWER_CHARS = 200_000
_MAX_DIAGNOSTICS = 8
RewardMode = Literal["kevin", "rank"]


def extract_cuda(text: str) -> str | None:
    """The CUDA source in a model reply: the last ```cuda / ```cpp / ```c++ block (an unclosed fence runs to the
    end), else the last untagged block that looks like CUDA C++; None if there is none."""
    if not isinstance(text, str) or not text.strip():
        return None
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE_RE.finditer(text)]
    tagged = [b for tag, b in blocks if tag in _CUDA_TAGS and b.strip()]
    if tagged:
        return tagged[-1]
    untagged = [b for tag, b in blocks if tag == "" and _LOOKS_CUDA_RE.search(b)]
    return untagged[-1] if untagged else None


def kevin_reward(correct: bool | None, speedup: float | None) -> float:
    """Kevin's ``0.3 * correct + speedup * correct``: 0 unless correctness was measured and passed (uncapped)."""
    if correct is not True:
        return 0.0
    return 0.3 + (float(speedup) if speedup is not None and speedup > 0 else 0.0)


@dataclass(frozen=True)
class KernelToolset:
    """The three kernel tools (``tools.cuda`` by default); tests may pass other callables with the same API."""

    compile: Callable[..., Any]
    check: Callable[..., Any]
    bench: Callable[..., Any]
    # () -> (available, detail): asked before cuda_check, whose no-GPU path would compile the source a second time
    device: Callable[[], tuple[bool, str]] | None = None

    @classmethod
    def default(cls) -> KernelToolset:
        from tools.cuda import cuda_bench, cuda_check, cuda_compile, cuda_device_available

        return cls(compile=cuda_compile, check=cuda_check, bench=cuda_bench, device=cuda_device_available)


@dataclass
class KernelOutcome:
    """What one candidate source achieved; ``failure_class`` is None only for a correct kernel."""

    found_code: bool
    compiled: bool = False
    compile_timed_out: bool = False
    first_error: str | None = None  # "line 12: error: identifier \"foo\" is undefined" (the first error diagnostic)
    n_errors: int = 0
    compile_s: float | None = None
    measured: bool = False  # cuda_check ran the kernel (a GPU machine)
    correct: bool | None = None  # None when not measured
    max_abs_err: float | None = None
    speedup: float | None = None  # measured by cuda_bench for a correct kernel
    kernel_ms: float | None = None
    eager_ms: float | None = None
    not_measured_reason: str | None = None
    observation: str = ""
    diagnostics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def benchmarked(self) -> bool:
        return self.speedup is not None

    @property
    def failure_class(self) -> str | None:
        """``format`` / ``compile_timeout`` / ``compile_error`` / ``unmeasured`` / ``runtime_error`` / ``incorrect``; None if correct."""
        return failure_class(
            found_code=self.found_code, compile_timed_out=self.compile_timed_out, compiled=self.compiled, measured=self.measured, correct=self.correct
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["failure_class"] = self.failure_class
        return out


def _diag_dict(d: Any) -> dict[str, Any]:
    return {k: getattr(d, k, None) for k in ("file", "line", "column", "severity", "message")}


def _diag_line(d: dict[str, Any]) -> str:
    where = f"line {d['line']}" if d.get("line") is not None else "(no line)"
    return f"{where}: {d.get('severity') or 'error'}: {d.get('message') or ''}".strip()


def evaluate_candidate(
    spec: KernelTaskSpec,
    source: str | None,
    toolset: KernelToolset,
    *,
    arch: str | None = None,
    compile_timeout_s: float = 180.0,
    check_timeout_s: float = 300.0,
    seed: int = 0,
) -> KernelOutcome:
    """Compile -> (if ok) check -> (if correct) bench one candidate; never raises on a bad candidate."""
    if source is None or not source.strip():
        return KernelOutcome(
            found_code=False,
            observation=("I could not find a CUDA source in your reply. Reply with the whole source file in one ```cuda code block. " + CONVENTION),
        )
    out = KernelOutcome(found_code=True)
    comp = toolset.compile(source, arch=arch, timeout_s=compile_timeout_s)
    out.compile_s = getattr(comp, "elapsed_s", None)
    out.diagnostics = [_diag_dict(d) for d in getattr(comp, "diagnostics", [])]
    errors = [d for d in out.diagnostics if (d.get("severity") or "").lower() in ("error", "fatal", "fatal error", "catastrophic error")]
    out.n_errors = len(errors)
    out.first_error = _diag_line(errors[0]) if errors else None
    if not comp.ok:
        out.compile_timed_out = bool(getattr(comp, "timed_out", False))
        if out.compile_timed_out:
            out.observation = f"Compilation timed out after {compile_timeout_s:g} s. Simplify the source and reply with the whole file."
            return out
        shown = errors[:_MAX_DIAGNOSTICS] or out.diagnostics[:_MAX_DIAGNOSTICS]
        lines = [_diag_line(d) for d in shown]
        if not lines:  # no parsed diagnostics: show the end of the log
            lines = (getattr(comp, "log", "") or "(no compiler output)").strip().splitlines()[-_MAX_DIAGNOSTICS:]
        more = f"\n... and {out.n_errors - len(shown)} more errors" if out.n_errors > len(shown) else ""
        out.observation = (
            f"Compilation failed ({out.n_errors or 'unparsed'} errors). Compiler output:\n"
            + "\n".join(lines)
            + more
            + "\nFix the errors and reply with the whole corrected source in one ```cuda code block."
        )
        if out.first_error is None and lines:
            out.first_error = lines[0][:300]
        return out
    out.compiled = True
    warn = [d for d in out.diagnostics if (d.get("severity") or "").lower() == "warning"]
    compiled_msg = f"Compiled OK in {out.compile_s:.1f} s" if out.compile_s is not None else "Compiled OK"
    if warn:
        compiled_msg += f" with {len(warn)} warnings (first: {_diag_line(warn[0])})"
    available, detail = toolset.device() if toolset.device is not None else (True, "")
    chk = toolset.check(source, spec.module, seed=seed, timeout_s=check_timeout_s) if available else None
    if chk is None or not chk.measured:
        out.not_measured_reason = f"no CUDA device: {detail}" if chk is None else (getattr(chk, "reason", None) or "no GPU")
        out.observation = (
            f"{compiled_msg}. Correctness and speed were not measured on this machine ({out.not_measured_reason}), "
            "so no correctness credit is given; nothing more can be checked here."
        )
        return out
    out.measured = True
    out.correct = chk.correct
    out.max_abs_err = getattr(chk, "max_abs_err", None)
    if chk.correct is not True:
        if chk.correct is None:
            reason = getattr(chk, "reason", None) or "the kernel did not run"
            out.observation = f"{compiled_msg}, but running it failed: {reason}. Fix it and reply with the whole source."
        else:
            err = f"max abs error {out.max_abs_err:.3g}" if out.max_abs_err is not None else "outputs differ"
            out.observation = (
                f"{compiled_msg}, but the output is wrong: {err} against the reference (atol = rtol = 1e-3). Fix it and reply with the whole source."
            )
        return out
    bench = toolset.bench(source, spec.module, timeout_s=check_timeout_s)
    if bench.measured and bench.speedup is not None:
        out.speedup, out.kernel_ms, out.eager_ms = float(bench.speedup), bench.kernel_ms, bench.eager_ms
        out.observation = (
            f"{compiled_msg}. Correct (max abs error {out.max_abs_err:.3g}). Kernel {bench.kernel_ms:.4f} ms vs eager PyTorch "
            f"{bench.eager_ms:.4f} ms: speedup {out.speedup:.2f}x."
        )
    else:
        out.observation = f"{compiled_msg}. Correct, but the benchmark was not measured ({getattr(bench, 'reason', None) or 'unknown'})."
    return out


class KernelEnv:
    """One kernel-writing episode; see the module docstring for the protocol."""

    def __init__(self, task: KernelTask, problem: Problem) -> None:
        self.task = task
        self.problem = problem
        self.spec = get_kernel_task(problem.metadata["spec"])
        self.max_turns = int(problem.metadata["max_turns"])
        self.turns = 0
        self.done = False
        self.outcomes: list[KernelOutcome] = []

    def reset(self) -> str:
        self.turns, self.done, self.outcomes = 0, False, []
        return f"You have {self.max_turns} attempts; after each one you get the compiler's and the checker's feedback."

    def _info(self, outcome: KernelOutcome | None, reward: float) -> dict[str, Any]:
        last = outcome.to_dict() if outcome is not None else {}
        return {
            "turn": self.turns,
            "outcome": last,
            "correct": outcome.correct if outcome is not None else None,
            "speedup": outcome.speedup if outcome is not None else None,
            "measured": outcome.measured if outcome is not None else False,
            "kevin_reward": kevin_reward(outcome.correct, outcome.speedup) if outcome is not None else 0.0,
            # what the agent loop records (agents/loop.py): correctness and the uncapped score, whose order within a
            # group is LEAP's "correct beats incorrect, then faster" (kevin_reward is monotone in speedup when correct)
            "score": kevin_reward(outcome.correct, outcome.speedup) if outcome is not None else 0.0,
            # what the trajectory's reward is: Kevin's uncapped value, or LEAP's 1 correct / 0 (reward="rank"; the
            # learner's rank estimator makes the group-relative reward from correct, score and tokens)
            "reward": self.task.recorded_reward(outcome) if outcome is not None else 0.0,
            "reward_mode": self.task.reward_mode,
            "episode_reward": reward,
            "format_error": outcome is not None and not outcome.found_code,
        }

    def step(self, action_text: str) -> EnvStep:
        if self.done:
            return EnvStep("The episode is over.", 0.0, True, self._info(self.outcomes[-1] if self.outcomes else None, 0.0))
        self.turns += 1
        outcome = self.task.evaluate(self.spec, extract_cuda(action_text) if isinstance(action_text, str) else None)
        self.outcomes.append(outcome)
        finished = outcome.benchmarked or (outcome.compiled and not outcome.measured)
        if finished or self.turns >= self.max_turns:
            self.done = True
            reward = self.task.reward_of(outcome)
            tail = "" if finished else f" That was the last of {self.max_turns} attempts."
            obs = f"{outcome.observation}{tail} The episode is over. Reward {reward:.3g}."
            log.info(
                "tasks.kernels.episode",
                task=self.spec.name,
                turns=self.turns,
                failure=outcome.failure_class,
                speedup=outcome.speedup,
                reward=reward,
            )
            return EnvStep(obs, reward, True, self._info(outcome, reward))
        left = self.max_turns - self.turns
        return EnvStep(f"{outcome.observation}\n({left} attempts left.)", 0.0, False, self._info(outcome, 0.0))


class KernelTask(TaskBase):
    """CUDA kernels for PyTorch reference modules; see the module docstring."""

    def __init__(
        self,
        *,
        name: str = "kernels",
        level: int | None = None,
        reward: RewardMode = "kevin",
        max_turns: int = 4,
        arch: str | None = None,
        compile_timeout_s: float = 180.0,
        check_timeout_s: float = 300.0,
        toolset: KernelToolset | None = None,
    ) -> None:
        if reward not in ("kevin", "rank"):
            raise ValueError(f"{name}: reward must be 'kevin' or 'rank', got {reward!r}")
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or not 1 <= max_turns <= 64:
            raise ValueError(f"{name}: max_turns must be an integer in [1, 64], got {max_turns!r}")
        if compile_timeout_s <= 0 or check_timeout_s <= 0:
            raise ValueError(f"{name}: timeouts must be positive")
        self.specs = kernel_tasks(level)  # raises ValueError on a bad level
        self.name = name
        self.level = level
        self.reward_mode: RewardMode = reward
        self.max_turns = max_turns
        self.arch = arch
        self.compile_timeout_s = compile_timeout_s
        self.check_timeout_s = check_timeout_s
        self._toolset = toolset
        self.tools = ()
        where = f"level {level}" if level is not None else "levels 1-3"
        self.description = f"CUDA kernels ({where}, {len(self.specs)} tasks): replace a PyTorch module with a faster correct kernel."

    @property
    def toolset(self) -> KernelToolset:
        if self._toolset is None:
            self._toolset = KernelToolset.default()
        return self._toolset

    def evaluate(self, spec: KernelTaskSpec, source: str | None) -> KernelOutcome:
        return evaluate_candidate(
            spec, source, self.toolset, arch=self.arch, compile_timeout_s=self.compile_timeout_s, check_timeout_s=self.check_timeout_s
        )

    def recorded_reward(self, outcome: KernelOutcome) -> float:
        """The trajectory reward the agent loop records: uncapped Kevin (``kevin``), or 1.0 correct / 0.0 (``rank``)."""
        if self.reward_mode == "rank":
            return 1.0 if outcome.correct is True else 0.0
        return kevin_reward(outcome.correct, outcome.speedup)

    def reward_of(self, outcome: KernelOutcome) -> float:
        """The episode reward in [0, 1] from what was measured (see the module docstring)."""
        if self.reward_mode == "rank":
            return 1.0 if outcome.correct is True else 0.0
        return min(1.0, kevin_reward(outcome.correct, outcome.speedup))

    def problems(self, n: int, seed: int = 0) -> list[Problem]:
        self._check_n(n)
        specs = list(self.specs)
        if seed != 0:
            random.Random(seed).shuffle(specs)
        if n > len(specs):
            log.warning("tasks.kernels.capped", requested=n, available=len(specs))
        return [self._problem(s, seed) for s in specs[:n]]

    def _problem(self, spec: KernelTaskSpec, seed: int) -> Problem:
        prompt = (
            f"Write a CUDA kernel that replaces this PyTorch module and is faster than eager PyTorch. Task: {spec.description}\n\n"
            f"```python\n{spec.reference_source.strip()}\n```\n\n{CONVENTION}\n\n"
            f"Reply with the whole source in one ```cuda code block. You have {self.max_turns} attempts."
        )
        meta = {"seed": seed, "spec": spec.name, "module": spec.module, "level": spec.level, "max_turns": self.max_turns, "reward": self.reward_mode}
        return Problem(self.name, f"{self.name}/{spec.name}", prompt, spec.solution, meta)

    def make_env(self, problem: Problem) -> KernelEnv:
        return KernelEnv(self, problem)

    def verify(self, problem: Problem, answer: str) -> Verdict:
        if not isinstance(answer, str) or not answer.strip():
            return Verdict(0.0, False, "empty answer").shown()
        if len(answer) > _MAX_ANSWER_CHARS:
            return Verdict(0.0, False, f"answer longer than {_MAX_ANSWER_CHARS} characters").shown()
        spec = get_kernel_task(problem.metadata["spec"])
        outcome = self.evaluate(spec, extract_cuda(answer))
        reward = self.reward_of(outcome)
        detail = outcome.failure_class or "correct"
        if outcome.first_error:
            detail += f": {outcome.first_error}"
        elif outcome.compiled and not outcome.measured:
            detail = f"compiled; correctness not measured on this machine ({outcome.not_measured_reason})"
        elif outcome.correct:
            detail = (
                f"correct, speedup {outcome.speedup:.2f}x, kevin reward {kevin_reward(True, outcome.speedup):.3g}"
                if outcome.benchmarked
                else "correct"
            )
        return Verdict(reward, outcome.correct is True, detail).shown()
