"""``bench/judge_probe.py``'s figure and ``bench/chat_learning_hook.py``'s reading of a multi-turn conversation.

The probe's figure, the chance that the judge scores a right answer above a wrong one of the same group (ties half),
is checked on groups worked out by hand; the hook must score a follow-up's answers against the problem asked before it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.judge_probe import summarize


def test_the_probe_counts_right_over_wrong_pairs_within_groups_ties_half():
    groups = [
        {"correct": [True, False, False, False], "scores": [0.5, 0.3, 0.5, 0.9]},  # pairs: 1, 0.5 (tie), 0
        {"correct": [False] * 4, "scores": [0.2] * 4},  # no right answer: no pair; all alike
        {"correct": [True, True, False, False], "scores": [0.8, 0.1, 0.4, 0.4]},  # pairs: 1, 1, 0, 0
    ]
    s = summarize(groups)
    assert (s["groups"], s["groups_with_right_and_wrong"], s["groups_scored_all_alike"], s["pairs"]) == (3, 2, 1, 7)
    assert s["p_right_scored_above_wrong"] == 0.5  # (1 + 0.5 + 0 + 1 + 1 + 0 + 0) / 7
    assert s["answers_right"] == 0.25 and s["mean_score_right"] == pytest.approx(1.4 / 3, abs=1e-4) and s["mean_score_wrong"] == 0.5


def test_the_hook_scores_a_follow_up_against_the_problem_asked_before_it(tmp_path: Path, monkeypatch):
    from agents.tasks import get_task
    from bench import chat_learning_hook
    from bench.live_traffic import FINAL_ONLY, ask

    spec = {"task": "basic_arithmetic", "options": {"max_terms": 2, "max_digits": 1}, "n": 5, "seed": 0}
    (tmp_path / "task.json").write_text(json.dumps(spec))
    monkeypatch.setenv("CHAT_LEARNING_TASK", str(tmp_path / "task.json"))
    chat_learning_hook._problems.cache_clear()
    try:
        task = get_task("basic_arithmetic", max_terms=2, max_digits=1)
        p, q = task.problems(5, seed=0)[:2]
        right, wrong = f"<answer>{p.answer}</answer>", f"<answer>{int(p.answer) + 1}</answer>"
        two_turns = [{"role": "user", "content": ask(p)}, {"role": "assistant", "content": "..."}, {"role": "user", "content": FINAL_ONLY}]
        assert chat_learning_hook.reward(two_turns, [right, wrong]) == [1.0, 0.0]
        assert chat_learning_hook.reward([{"role": "user", "content": p.prompt}], [right]) == [1.0]  # the task's own prompt too
        later = [*two_turns, {"role": "assistant", "content": right}, {"role": "user", "content": ask(q)}]  # the newest problem counts
        assert chat_learning_hook.reward(later, [right, f"<answer>{q.answer}</answer>"]) == [float(p.answer == q.answer), 1.0]
        assert chat_learning_hook.reward([{"role": "user", "content": "hello"}], [right]) == [0.0]
    finally:
        chat_learning_hook._problems.cache_clear()
