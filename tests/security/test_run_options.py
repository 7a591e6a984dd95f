"""Runs take no resources from the caller: task options (a sandbox's 600 s / 64 GB) are the admin's, and the
problem lists cached per (task, seed) are bounded (a list was kept per seed without end: 65 MB per run)."""

from __future__ import annotations

import pytest

from agents.host import ProblemCache
from agents.tasks.base import Problem
from tests.security._app import ADMIN, KEY1, auth, served


def test_a_user_key_cannot_set_task_options(tmp_path, tiny_model_path):
    from agents.host import Host
    from tools.builtins import default_registry

    agent = {"name": "calc", "tools": [], "task": "calc_arith", "max_turns": 1, "max_tokens_per_turn": 4}
    with served(tmp_path, tiny_model_path, agents=Host([agent], default_registry(python=False, cuda=False))) as app:
        body = {"task": "humaneval", "problem_index": 0, "task_options": {"wall_s": 600, "cpu_s": 600, "memory_mb": 65536}}
        r = app.post("/v1/agents/calc/runs", json=body, headers=auth(KEY1))
        assert r.status_code == 403, r.text
        assert r.json()["error"]["type"] == "permission_error" and "task_options" in r.json()["error"]["message"]
        ok = app.post("/admin/agents/calc/runs", json={"problem_index": 0, "task_options": {"n_ops": 1}}, headers=auth(ADMIN))
        assert ok.status_code == 200, ok.text


class _Counting:
    """A prefix-stable task whose problems are cheap; counts how many it generated."""

    name = "counting"

    def __init__(self) -> None:
        self.generated = 0

    def problems(self, n: int, seed: int = 0) -> list[Problem]:
        self.generated += n
        return [Problem(task="counting", id=f"{seed}-{i}", prompt=f"p{i}", answer=i, metadata={}) for i in range(n)]


def test_the_problem_cache_is_bounded() -> None:
    task = _Counting()
    cache = ProblemCache(max_lists=4, max_problems=256)
    for seed in range(40):
        assert cache.get(task, 3, seed).id == f"{seed}-3"  # type: ignore[arg-type]
    assert len(cache) == 4
    held = sum(len(v) for v in cache._lists.values())
    assert held <= 4 * 256
    # a far index is answered exactly, but never cached
    before = task.generated
    assert cache.get(task, 9_999, seed=7).prompt == "p9999"  # type: ignore[arg-type]
    assert task.generated - before == 10_000 and len(cache) == 4 and sum(len(v) for v in cache._lists.values()) == held


@pytest.mark.parametrize("index", [0, 63, 64, 200])
def test_cached_problems_are_the_tasks_own(index: int) -> None:
    task = _Counting()
    cache = ProblemCache(max_lists=2, max_problems=256)
    assert cache.get(task, index, 1).id == task.problems(index + 1, seed=1)[index].id  # type: ignore[arg-type]
