"""TCPO's verifier-feedback mode for any single-answer task: ``feedback:<task>`` (``docs/methods.md``, TCPO).

    task = get_task("feedback:calc_arith", n_ops=2)      # the inner task's options pass through
    env = task.make_env(task.problems(1)[0])

Each turn's reply is a candidate answer; the inner task's verifier scores it (``v_t``, its reward in [0, 1])
and the score is shown to the model before the next turn: "The verifier checked your answer: <feedback>
(score 0.00). Try again." ``<feedback>`` is the verdict's ``feedback`` (what the inner task lets a solver see:
"7 is not correct", never the gold answer; its ``detail`` may name the gold and stays in the run's info for
logs). The episode ends at the first correct answer (or at the agent's turn cap).
What is recorded for the learner:

* every turn's verifier score as its process score (turn reward, ``verifier:feedback:<task>:process``):
  TCPO's ``v_t``, from which its retrospective and hindsight credit are built;
* the trajectory's reward: the best score over its turns (the sum of the env's progress rewards
  ``max(0, v_t - best_{t-1})``), i.e. the best-turn score TCPO's Best-turn Pass@k counts; ``correct``
  when some turn was correct.

It also makes a multi-turn task out of a single-turn one on which a small model succeeds sometimes,
so turn-level credit (RTPO, TCPO, turn GRPO) has something to separate. The problems, task key and
final verification are the inner task's, so a problem's runs group together as usual.

Not here: the credit itself (``learner.advantages.tcpo``), the agent loop.
"""

from __future__ import annotations

from typing import Any

from .base import EnvStep, PrefixState, Problem, Task, TaskBase, Verdict

PREFIX = "feedback:"
_RETRY = "Try again: give your corrected final answer."


class VerifierFeedbackEnv:
    """One problem, answered until correct; each reply is verified and the verdict is the next observation."""

    def __init__(self, inner: Task, problem: Problem) -> None:
        self.inner, self.problem = inner, problem
        self.best = 0.0
        self.turns = 0
        self.correct = False

    def reset(self) -> str:
        self.best, self.turns, self.correct = 0.0, 0, False
        return "After each answer a verifier checks it and tells you its score; you can then answer again."

    def step(self, action_text: str) -> EnvStep:
        self.turns += 1
        verdict = self.inner.verify(self.problem, action_text)
        gain = max(0.0, verdict.reward - self.best)
        self.best = max(self.best, verdict.reward)
        self.correct = self.correct or verdict.correct
        info: dict[str, Any] = {"score": self.best, "correct": self.correct, "turn_score": verdict.reward, "detail": verdict.detail}
        said = f": {verdict.feedback}" if verdict.feedback else ""  # never the detail: it may name the gold answer
        if verdict.correct:
            return EnvStep(f"The verifier checked your answer{said} (score {verdict.reward:.2f}). Done.", gain, True, info)
        return EnvStep(f"The verifier checked your answer{said} (score {verdict.reward:.2f}). {_RETRY}", gain, False, info)


class VerifierFeedbackTask(TaskBase):
    """``feedback:<inner>``: the inner task's problems, answered over turns with the verifier's score shown in between."""

    def __init__(self, inner: Task) -> None:
        self.inner = inner
        self.name = f"{PREFIX}{inner.name}"
        self.description = f"{inner.description} (verifier feedback between turns)"
        self.tools = tuple(inner.tools)

    def problems(self, n: int, seed: int = 0) -> list[Problem]:
        return self.inner.problems(n, seed)

    def verify(self, problem: Problem, answer: str) -> Verdict:
        return self.inner.verify(problem, answer)

    def process_score(self, problem: Problem, turn_text: str) -> float | None:
        """TCPO's ``v_t``: the inner verifier's score of this turn's candidate."""
        return self.inner.verify(problem, turn_text).reward

    def task_key(self, problem: Problem) -> str:
        return self.inner.task_key(problem)

    def score_prefix(self, problem: Problem, state: PrefixState) -> float | None:
        """PATR's process score: the best verifier score so far (the inner task's own scorer before the first answer)."""
        if isinstance(state.env, VerifierFeedbackEnv) and state.env.turns:
            return state.env.best
        fn = getattr(self.inner, "score_prefix", None)
        return fn(problem, state) if callable(fn) else None

    def signature(self, problem: Problem) -> str | None:
        fn = getattr(self.inner, "signature", None)
        return fn(problem) if callable(fn) else None

    def make_env(self, problem: Problem) -> VerifierFeedbackEnv:
        return VerifierFeedbackEnv(self.inner, problem)
