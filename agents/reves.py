"""REVES prompts on the runs endpoint: a repair or a verification prompt built from a task problem and a previous answer.

REVES (Liu et al. 2026, arXiv 2606.18910; prompts paraphrased from its public code, ``prompt/math_pmt.py``) turns
a near-miss answer into two separate training prompts:

* **repair** — Problem / Previous Answer (the model's whole previous output) / ``Feedback: The previous answer is
  incorrect.`` / a request for a corrected answer. Scored by the task's own verifier.
* **verify** — Problem / Candidate Answer / a request to check it and end with ``VERDICT: \\boxed{True}`` or
  ``\\boxed{False}``. Scored by whether that verdict matches the task verifier's judgment of the candidate (the
  label is computed here from the candidate, never taken from the caller). The learner draws as many candidates
  judged right as wrong, the first wrong answer included (``learner/reves.py``), so a constant verdict earns 1/2.

A run asks for one with ``"reves": {"kind": "repair" | "verify", "previous": "..."}`` next to its task problem
(admin only: the learner's augmentation, ``learner/reves.py``). The prompt replaces the problem's prompt; the task
is wrapped so the run's reward source is ``verifier:reves-repair:<task>`` / ``verifier:reves-verify:<task>``: they
train (``verifier:*``) but never count as the task's A/B metric, and the problem's task key (with the learner's
group tag) still groups the runs of one augmented prompt.

Not here: choosing what to augment (``learner/reves.py``), the agent loop.
"""

from __future__ import annotations

import re
from typing import Literal

from agents.stop import extract_final_answer
from agents.tasks import Problem, Task, TaskBase, Verdict

RevesKind = Literal["repair", "verify"]

REPAIR_TEMPLATE = (
    "Problem:\n{problem}\n\nPrevious Answer:\n{previous}\n\nFeedback: The previous answer is incorrect.\n\n"
    "Find the mistake in the previous answer and give a corrected solution, with the final answer in the format the problem asks for."
)
VERIFY_TEMPLATE = (
    "Problem:\n{problem}\n\nCandidate Answer:\n{candidate}\n\n"
    "You are a strict verifier. Check the candidate answer step by step. "
    "Then end with a final line VERDICT: \\boxed{{True}} if the candidate answer is correct, or VERDICT: \\boxed{{False}} if it is not."
)
_BOXED = re.compile(r"\\boxed\{\s*(true|false)\s*\}", re.I)


def reves_prompt(kind: RevesKind, problem: str, previous: str) -> str:
    """The user message of a repair or verification prompt (``str.format`` with the braces of ``\\boxed{}`` escaped)."""
    if kind == "repair":
        return REPAIR_TEMPLATE.format(problem=problem, previous=previous)
    return VERIFY_TEMPLATE.format(problem=problem, candidate=previous)


def parse_verdict(text: str) -> bool | None:
    """The last ``\\boxed{True}`` / ``\\boxed{False}`` in ``text`` (case-insensitive), else a bare ``True``/``False`` answer; None if neither."""
    found = _BOXED.findall(text)
    if found:
        return str(found[-1]).lower() == "true"
    bare = text.strip().strip(".").lower()
    return {"true": True, "false": False}.get(bare)


class _Wrapped(TaskBase):
    def __init__(self, inner: Task, prefix: str) -> None:
        self.inner = inner
        self.name = f"{prefix}:{inner.name}"
        self.description = f"{inner.description} ({prefix})"
        self.tools = tuple(inner.tools)

    def problems(self, n: int, seed: int = 0) -> list[Problem]:
        return self.inner.problems(n, seed)

    def task_key(self, problem: Problem) -> str:
        return self.inner.task_key(problem)


class RepairTask(_Wrapped):
    """``reves-repair:<task>``: the inner task's verifier on the repaired answer."""

    def __init__(self, inner: Task) -> None:
        super().__init__(inner, "reves-repair")

    def verify(self, problem: Problem, answer: str) -> Verdict:
        return self.inner.verify(problem, answer)


class VerificationTask(_Wrapped):
    """``reves-verify:<task>``: reward 1 when the run's boxed verdict equals the inner verifier's judgment of ``candidate``."""

    def __init__(self, inner: Task, problem: Problem, candidate: str) -> None:
        super().__init__(inner, "reves-verify")
        self.label = inner.verify(problem, extract_final_answer(candidate)).correct

    def verify(self, problem: Problem, answer: str) -> Verdict:
        said = parse_verdict(answer)
        if said is None:
            return Verdict(0.0, False, f"no VERDICT \\boxed{{True|False}} found (the candidate is {'right' if self.label else 'wrong'})")
        match = said == self.label
        return Verdict(1.0 if match else 0.0, match, f"verdict {said}, the candidate is {'right' if self.label else 'wrong'}")


def reves_run(kind: RevesKind, previous: str, task: Task, problem: Problem) -> tuple[Task, str]:
    """The task that scores a REVES run and its user message."""
    wrapped: Task = RepairTask(task) if kind == "repair" else VerificationTask(task, problem, previous)
    return wrapped, reves_prompt(kind, problem.prompt, previous)
