"""REVES augmentation (``learner/reves.py``) and its prompts and scoring on the runs endpoint (``agents/reves.py``).

The augmentation is driven by a scripted policy (a table of answers per item and round, the verifier's judgment
given with each), so record counts, order, quoted answers and labels are checked against what REVES's planner
writes by definition: k repair + k verification records for an item recovered in round k, exactly one True.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from agents.reves import RepairTask, VerificationTask, parse_verdict, reves_prompt
from agents.tasks import get_task
from learner.config import RevesConfig
from learner.reves import Attempt, RevesRecord, augment, augment_item, training_bodies


def scripted(answers: dict[int, list[tuple[str, bool]]], calls: list[tuple[int, str | None, int]]):
    """Item i's attempt r (0 = the first answer, r >= 1 = repair round r) is answers[i][r]."""

    async def attempt(i: int, previous: str | None, r: int) -> Attempt | None:
        calls.append((i, previous, r))
        text, ok = answers[i][r]
        return Attempt(text, ok, tokens=10)

    return attempt


def test_an_item_recovered_in_round_k_gives_k_repair_and_k_verification_records() -> None:
    answers = {7: [("y0: 41", False), ("y1: 40", False), ("y2: 43", False), ("y3: 42", True), ("never", True)]}
    calls: list = []
    records = asyncio.run(augment_item(7, scripted(answers, calls), max_retries=8))
    assert records is not None and len(records) == 6  # k = 3
    assert [(r.kind, r.round) for r in records] == [("repair", 1), ("verify", 1), ("repair", 2), ("verify", 2), ("repair", 3), ("verify", 3)]
    # each repair prompt quotes the previous full answer; each verification judges that round's answer
    assert [r.previous for r in records if r.kind == "repair"] == ["y0: 41", "y1: 40", "y2: 43"]
    assert [(r.previous, r.label) for r in records if r.kind == "verify"] == [("y1: 40", False), ("y2: 43", False), ("y3: 42", True)]
    assert sum(r.label is True for r in records) == 1 and all(r.label is None for r in records if r.kind == "repair")
    assert all(r.previous != "y0: 41" for r in records if r.kind == "verify")  # the first answer gets no verification record
    assert [c[2] for c in calls] == [0, 1, 2, 3]  # stops at the recovery
    assert calls[1][1] == "y0: 41" and calls[0][1] is None
    assert len({r.group for r in records}) == 6  # every augmented prompt is its own group


def test_unrecovered_and_first_shot_items_give_nothing() -> None:
    calls: list = []
    never = {1: [("a", False), ("b", False), ("c", False), ("d", True)]}  # would recover in round 3, but max_retries = 2
    assert asyncio.run(augment_item(1, scripted(never, calls), max_retries=2)) is None and len(calls) == 3
    calls.clear()
    solved = {2: [("right", True), ("x", True)]}
    assert asyncio.run(augment_item(2, scripted(solved, calls), max_retries=8)) is None and calls == [(2, None, 0)]

    async def failing(i: int, previous: str | None, r: int) -> Attempt | None:
        return Attempt("wrong", False) if r == 0 else None  # the repair run failed: nothing half-built

    assert asyncio.run(augment_item(3, failing, max_retries=8)) is None


def test_augment_report_counts_items_by_outcome() -> None:
    answers = {
        0: [("r", True)],  # first-shot solved
        1: [("w", False), ("r", True)],  # recovered in round 1
        2: [("w", False), ("w", False), ("w", False)],  # unrecovered with max_retries = 2
        3: [("w", False), ("w", False), ("r", True)],  # recovered in round 2
    }
    report = asyncio.run(augment([0, 1, 2, 3], scripted(answers, []), max_retries=2))
    s = report.summary()
    assert (s["items"], s["first_shot_solved"], s["recovered"], s["unrecovered"], s["failed"]) == (4, 1, 2, 1, 0)
    assert s["records"] == {"repair": 3, "verify": 3} and s["rounds"] == {1: 1, 2: 1}
    assert s["sampled_tokens"] == 10 * (1 + 2 + 3 + 3)  # every attempt's tokens, also those of items that gave nothing
    assert [r.problem_index for r in report.records] == [1, 1, 3, 3, 3, 3]


def test_training_prompts_mix_augmented_and_original_at_the_configured_share() -> None:
    pool = [RevesRecord("repair", 5, 1, "prev"), RevesRecord("verify", 5, 1, "cand", True), RevesRecord("verify", 6, 1, "c2", False)]
    cfg = RevesConfig(enabled=True, prompts_per_round=4, augmented_share=0.5, group=3, seed=9)
    bodies, counts = training_bodies(pool, [10, 11, 12, 13], cfg, sample_seed=100, model="fam@2", rng=random.Random(0))
    assert counts["repair_prompts"] + counts["verify_prompts"] == 2 and counts["original_prompts"] == 2 and len(bodies) == 4 * 3
    aug = [b for b in bodies if "reves" in b]
    assert len(aug) == 6 and len({b["group"] for b in aug}) == 2 and {b["sample_seed"] for b in aug} == {100, 101, 102}
    assert all(b["seed"] == 9 and b["model"] == "fam@2" and b["max_turns"] == 1 for b in bodies)
    assert sorted({b["problem_index"] for b in bodies if "reves" not in b}) == [10, 11]
    # a pool smaller than its share: all of it, the rest original
    bodies, counts = training_bodies(pool[:1], [10, 11, 12, 13], cfg, sample_seed=0, model=None, rng=random.Random(0))
    assert counts == {"repair_prompts": 1, "verify_prompts": 0, "original_prompts": 3} and "model" not in bodies[0]
    only_plain = RevesConfig(enabled=True, prompts_per_round=2, augmented_share=0.0, group=2)
    assert training_bodies(pool, [1, 2], only_plain, sample_seed=0, model=None, rng=random.Random(0))[1]["original_prompts"] == 2


# ---- the prompts and their scoring (agents/reves.py) -------------------------------------------------------------


def test_verification_template_keeps_the_boxed_verdict_and_repair_quotes_the_previous_answer() -> None:
    v = reves_prompt("verify", "What is {x}?", "It is {42}")  # braces in the inputs are data, not fields
    assert "VERDICT: \\boxed{True}" in v and "\\boxed{False}" in v and "What is {x}?" in v and "It is {42}" in v
    r = reves_prompt("repair", "P", "my whole answer <think>steps</think> 5")
    assert "Previous Answer:\nmy whole answer <think>steps</think> 5" in r and "Feedback: The previous answer is incorrect." in r


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("checks out. VERDICT: \\boxed{True}", True),
        ("\\boxed{true} ... on second thought VERDICT: \\boxed{ False }", False),
        ("False", False),
        ("<answer>True</answer>", None),  # an answer element is not a verdict: the loop hands over the extracted text instead
        ("I think it is fine", None),
    ],
)
def test_parse_verdict(text: str, said: bool | None) -> None:
    assert parse_verdict(text) is said


def test_verification_and_repair_tasks_score_by_the_inner_verifier() -> None:
    task = get_task("basic_arithmetic")
    problem = task.problems(1, seed=3)[0]
    right, wrong = f"work... <answer>{problem.answer}</answer>", f"<answer>{int(problem.answer) + 1}</answer>"
    on_right, on_wrong = VerificationTask(task, problem, right), VerificationTask(task, problem, wrong)
    assert on_right.label is True and on_wrong.label is False
    assert on_right.verify(problem, "VERDICT: \\boxed{True}").reward == 1.0 and on_right.verify(problem, "\\boxed{False}").reward == 0.0
    assert on_wrong.verify(problem, "\\boxed{False}").reward == 1.0 and on_wrong.verify(problem, "\\boxed{True}").reward == 0.0
    assert on_wrong.verify(problem, "no verdict").reward == 0.0
    assert on_right.name == "reves-verify:basic_arithmetic" and on_right.task_key(problem) == task.task_key(problem)
    repair = RepairTask(task)
    assert repair.name == "reves-repair:basic_arithmetic" and repair.verify(problem, str(problem.answer)).correct
