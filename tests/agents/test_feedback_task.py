"""``feedback:<task>`` shows the solver the verifier's score and what it read, never the gold answer.

Found in issue 39's run a: the observation was the verdict's log detail ("expected 12, got 7"), so the second
turn could copy the answer and every method learned to be wrong once and then copy."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.tasks import get_task
from agents.tasks.base import Verdict

NUMERIC = [
    ("calc_arith", {"n_ops": 1, "use_tools": False}),
    ("calc_arith", {"n_ops": 2, "use_tools": False}),
    ("chain_sum", {}),
    ("basic_arithmetic", {}),
]


def _numbers(text: str) -> set[str]:
    return set(re.findall(r"-?\d+(?:\.\d+)?", text))


@pytest.mark.parametrize(("inner", "options"), NUMERIC)
@settings(max_examples=25, deadline=None)
@given(index=st.integers(0, 40), offset=st.integers(-50, 50).filter(bool), tagged=st.booleans())
def test_a_wrong_answer_is_answered_without_the_gold(inner, options, index, offset, tagged):
    task = get_task(f"feedback:{inner}", **options)
    problem = task.problems(index + 1, seed=7)[index]
    gold = int(problem.answer)
    wrong = str(gold + offset)
    env = task.make_env(problem)
    env.reset()
    step = env.step(f"<answer>{wrong}</answer>" if tagged else f"I think it is {wrong}")
    assert not step.done and step.reward == 0.0
    assert str(gold) not in _numbers(step.observation), step.observation  # the detail said "expected <gold>"
    assert wrong in step.observation and "score 0.00" in step.observation and "Try again" in step.observation
    assert step.info["detail"].startswith("expected")  # the log detail keeps the gold for reports
    right = env.step(f"<answer>{gold}</answer>")
    assert right.done and right.reward == 1.0 and "score 1.00" in right.observation


def test_a_verdict_without_feedback_shows_the_score_only():
    class Secretive:
        name, description, tools = "secretive", "a task whose details name the answer", ()

        def problems(self, n, seed=0):
            return get_task("calc_arith", n_ops=1).problems(n, seed)

        def verify(self, problem, answer):
            return Verdict(0.0, False, f"the answer was {problem.answer}")  # no feedback given: nothing but the score is shown

        def task_key(self, problem):
            return problem.id

    from agents.tasks.feedback import VerifierFeedbackTask

    task = VerifierFeedbackTask(Secretive())  # type: ignore[arg-type]
    env = task.make_env(task.problems(1)[0])
    env.reset()
    step = env.step("42")
    assert step.observation == "The verifier checked your answer (score 0.00). Try again: give your corrected final answer."


def test_tasks_whose_details_name_no_answer_show_them():
    lake = get_task("frozenlake")
    problem = lake.problems(1, seed=0)[0]
    verdict = lake.verify(problem, "no moves here")
    assert verdict.feedback == verdict.detail and "no move sequence" in verdict.feedback
