"""REVES augmentation (``learner/reves.py``) and its prompts and scoring on the runs endpoint (``agents/reves.py``).

The augmentation is driven by a scripted policy (a table of answers per item and round, the verifier's judgment
given with each), so record counts, order, quoted answers and labels are checked against what REVES's planner
writes by definition, with the first wrong answer as one more candidate: k repair + k + 1 verification records for
an item recovered in round k, k labelled False and one True. The label balance of the verification prompts is checked
by its definition too: as many of each label in the pool and in every round's draw, so a constant verdict earns 1/2.
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


def test_an_item_recovered_in_round_k_gives_k_repair_and_k_plus_1_verification_records() -> None:
    answers = {7: [("y0: 41", False), ("y1: 40", False), ("y2: 43", False), ("y3: 42", True), ("never", True)]}
    calls: list = []
    records = asyncio.run(augment_item(7, scripted(answers, calls), max_retries=8))
    assert records is not None and len(records) == 3 + 4  # k = 3: 3 repair, 3 + 1 verification
    kinds = [("verify", 0), ("repair", 1), ("verify", 1), ("repair", 2), ("verify", 2), ("repair", 3), ("verify", 3)]
    assert [(r.kind, r.round) for r in records] == kinds
    # each repair prompt quotes the previous full answer; each verification judges that round's answer, and the first
    # wrong answer is a candidate too (REVES's planner leaves it out; without it an item recovered in round 1 gave a True only)
    assert [r.previous for r in records if r.kind == "repair"] == ["y0: 41", "y1: 40", "y2: 43"]
    verify = [(r.previous, r.label) for r in records if r.kind == "verify"]
    assert verify == [("y0: 41", False), ("y1: 40", False), ("y2: 43", False), ("y3: 42", True)]
    assert sum(r.label is True for r in records) == 1 and sum(r.label is False for r in records) == 3
    assert all(r.label is None for r in records if r.kind == "repair")
    assert [c[2] for c in calls] == [0, 1, 2, 3]  # stops at the recovery
    assert calls[1][1] == "y0: 41" and calls[0][1] is None
    assert len({r.group for r in records}) == 7  # every augmented prompt is its own group
    # recovered in round 1: one candidate of each label
    once = asyncio.run(augment_item(8, scripted({8: [("z0", False), ("z1", True)]}, []), max_retries=8))
    assert once is not None and [(r.kind, r.previous, r.label) for r in once] == [
        ("verify", "z0", False),
        ("repair", "z0", None),
        ("verify", "z1", True),
    ]


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
    assert s["records"] == {"repair": 3, "verify": 2 + 3} and s["rounds"] == {1: 1, 2: 1}
    assert s["verify_labels"] == {"true": 2, "false": 1 + 2}  # item 1: its first answer False, round 1 True; item 3: F, F, T
    assert s["sampled_tokens"] == 10 * (1 + 2 + 3 + 3)  # every attempt's tokens, also those of items that gave nothing
    assert [r.problem_index for r in report.records] == [1, 1, 1, 3, 3, 3, 3, 3]


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
    assert (counts["repair_prompts"], counts["verify_prompts"], counts["original_prompts"]) == (1, 0, 3) and "model" not in bodies[0]
    only_plain = RevesConfig(enabled=True, prompts_per_round=2, augmented_share=0.0, group=2)
    assert training_bodies(pool, [1, 2], only_plain, sample_seed=0, model=None, rng=random.Random(0))[1]["original_prompts"] == 2


# ---- label balance of the verification prompts -------------------------------------------------------------------


def always(verdict: bool, bodies: list[dict], labels: dict[str, bool]) -> float:
    """Mean reward of a constant verdict over the verification runs in ``bodies`` (REVES: 1 when verdict == label)."""
    verify = [b for b in bodies if b.get("reves", {}).get("kind") == "verify"]
    return sum(labels[b["reves"]["previous"]] == verdict for b in verify) / len(verify)


def test_the_pool_balances_its_labels_and_every_round_draws_them_in_pairs() -> None:
    from learner.reves import balanced_pool

    # three recovered items: a in round 1, b in round 3, c in round 1. By definition (each wrong answer, the first
    # included, is a False candidate; each recovery a True one): 3 True, 1 + 3 + 1 = 5 False, 1 + 3 + 1 = 5 repairs
    answers = {
        0: [("a0", False), ("a1", True)],
        1: [("b0", False), ("b1", False), ("b2", False), ("b3", True)],
        2: [("c0", False), ("c1", True)],
    }
    report = asyncio.run(augment([0, 1, 2], scripted(answers, []), max_retries=8))
    s = report.summary()
    assert s["records"] == {"repair": 5, "verify": 8} and s["verify_labels"] == {"true": 3, "false": 5}
    labels = {r.previous: bool(r.label) for r in report.records if r.kind == "verify"}

    # balanced: the 3 Trues, 3 of the 5 Falses, every repair
    pool = balanced_pool(report.records, random.Random(0))
    assert sum(r.label is True for r in pool) == 3 and sum(r.label is False for r in pool) == 3
    assert [r.previous for r in pool if r.kind == "repair"] == ["a0", "b0", "b1", "b2", "c0"] and len(pool) == 11
    assert {r.previous for r in pool if r.label is True} == {"a1", "b3", "c1"}

    # 4 REVES prompts from a pool of P = 11 with m = 3 pairs: round(4 · 3 / 11) = 1 pair, 2 repairs, 4 original problems
    cfg = RevesConfig(enabled=True, prompts_per_round=8, augmented_share=0.5, group=2, seed=0)
    bodies, c = training_bodies(report.records, list(range(10, 20)), cfg, sample_seed=0, model=None, rng=random.Random(1))
    assert (c["repair_prompts"], c["verify_true_prompts"], c["verify_false_prompts"], c["original_prompts"]) == (2, 1, 1, 4)
    assert c["verify_prompts"] == 2 and c["balanced_pool"] == {"repair": 5, "verify_true": 3, "verify_false": 3} and len(bodies) == 8 * 2
    assert always(True, bodies, labels) == 0.5 and always(False, bodies, labels) == 0.5  # a constant verdict earns chance

    # the whole balanced pool (16 prompts, 11 in the pool): 3 pairs, 5 repairs, 5 original problems
    cfg = RevesConfig(enabled=True, prompts_per_round=16, augmented_share=1.0, group=2, seed=0)
    bodies, c = training_bodies(report.records, list(range(10, 20)), cfg, sample_seed=0, model=None, rng=random.Random(2))
    assert (c["repair_prompts"], c["verify_true_prompts"], c["verify_false_prompts"], c["original_prompts"]) == (5, 3, 3, 5)
    assert always(True, bodies, labels) == 0.5 and always(False, bodies, labels) == 0.5


def test_a_true_heavy_pool_is_subsampled_to_one_true_per_false() -> None:
    from learner.reves import balanced_pool

    # 4 candidates judged right, 1 wrong, 1 repair (REVES's planner's shape when most items recover in round 1): drawn
    # as they are, "always True" would score 4/5; balanced, 1 True and 1 False are left, and it scores 1/2
    right = [RevesRecord("verify", i, 1, f"right {i}", True) for i in range(4)]
    pool = [*right, RevesRecord("verify", 4, 1, "wrong", False), RevesRecord("repair", 4, 1, "wrong 0")]
    labels = {r.previous: bool(r.label) for r in pool if r.kind == "verify"}
    cfg = RevesConfig(enabled=True, prompts_per_round=6, augmented_share=1.0, group=2, seed=0)
    bodies, c = training_bodies(pool, [20, 21, 22, 23, 24, 25], cfg, sample_seed=0, model=None, rng=random.Random(0))
    # balanced pool: P = 3 (1 repair, 1 pair), n = min(3, 6) = 3 → round(3 · 1 / 3) = 1 pair, 1 repair, 3 original problems
    assert c["balanced_pool"] == {"repair": 1, "verify_true": 1, "verify_false": 1}
    assert (c["repair_prompts"], c["verify_true_prompts"], c["verify_false_prompts"], c["original_prompts"]) == (1, 1, 1, 3)
    assert always(True, bodies, labels) == 0.5
    # one label only: no verification prompt at all (alone it would reward a constant verdict)
    only_true = [r for r in pool if r.label is not False]
    assert all(r.kind == "repair" for r in balanced_pool(only_true, random.Random(0)))
    bodies, c = training_bodies(only_true, [20, 21, 22, 23, 24, 25], cfg, sample_seed=0, model=None, rng=random.Random(0))
    assert (c["repair_prompts"], c["verify_prompts"], c["original_prompts"]) == (1, 0, 5)


def test_a_repeated_answer_is_one_candidate() -> None:
    from learner.reves import balanced_pool

    # the policy repeats its wrong answer word for word in round 1: the same verification prompt and the same repair
    # prompt twice (one group tag each); the pool counts each once
    answers = {5: [("same", False), ("same", False), ("fixed", True)]}
    records = asyncio.run(augment_item(5, scripted(answers, []), max_retries=8))
    assert records is not None and len(records) == 2 + 3
    pool = balanced_pool(records, random.Random(0))
    assert [(r.kind, r.previous, r.label) for r in pool] == [("verify", "same", False), ("repair", "same", None), ("verify", "fixed", True)]


def test_reves_round_reports_the_label_balance(monkeypatch: pytest.MonkeyPatch) -> None:
    # the runs endpoint scripted: item 0 recovered in round 1, item 1 solved first-shot, item 2 recovered in round 2
    import learner.reves as reves_mod

    script = {0: [False, True], 1: [True], 2: [False, False, True]}
    posted: list[dict] = []

    async def fake_post(base_url, api_key, agent, bodies, **kw):
        out = []
        for b in bodies:
            if b.get("group") == reves_mod.AUGMENT_GROUP:  # attempt r of item i (sample_seed 0 + r)
                i, r = b["problem_index"], b["sample_seed"]
                out.append({"steps": [{"text": f"item {i} attempt {r}"}], "correct": script[i][r], "completion_tokens": 5})
            else:
                posted.append(b)
                out.append({"trajectory_id": f"t{len(posted)}", "reward": 1.0, "completion_tokens": 3})
        return out

    monkeypatch.setattr(reves_mod, "post_runs_async", fake_post)
    cfg = RevesConfig(enabled=True, items_per_round=3, max_retries=4, prompts_per_round=8, augmented_share=1.0, group=2, seed=0)
    out = reves_mod.reves_round("http://x", "k", "a", cfg, first_item=0, sample_seed=0, model=None)
    assert (out["recovered"], out["first_shot_solved"], out["items"]) == (2, 1, [0, 3])
    # item 0: F (first answer), T; item 2: F, F, T
    assert out["records"] == {"repair": 1 + 2, "verify": 2 + 3} and out["verify_labels"] == {"true": 2, "false": 3}
    # balanced: 3 repairs and 2 pairs, P = 7; n = min(7, 8) = 7 → round(7 · 2 / 7) = 2 pairs, 3 repairs, 1 original problem
    assert out["balanced_pool"] == {"repair": 3, "verify_true": 2, "verify_false": 2}
    assert (out["repair_prompts"], out["verify_true_prompts"], out["verify_false_prompts"], out["original_prompts"]) == (3, 2, 2, 1)
    kinds = [b.get("reves", {}).get("kind", "original") for b in posted]
    assert (kinds.count("verify"), kinds.count("repair"), kinds.count("original")) == (4 * 2, 3 * 2, 1 * 2) and out["training_runs"] == 16
    verified = {b["reves"]["previous"] for b in posted if b.get("reves", {}).get("kind") == "verify"}
    assert {"item 0 attempt 1", "item 2 attempt 2"} <= verified and len(verified) == 4  # both Trues and two of the three Falses


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
