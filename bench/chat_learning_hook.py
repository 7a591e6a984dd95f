"""The reward hook of ``bench/chat_learning.py``: the task's own check, as a user's ``module:function`` hook.

``reward(messages, completions)`` finds the problem the conversation is about: the latest user message that is one
of the benchmark's problems, as its prompt or as ``bench/live_traffic.py``'s users ask it (without the format example),
so a follow-up ("the final answer only") is scored against the problem asked before it (the benchmark writes its
task, options and seed to the file named by ``CHAT_LEARNING_TASK``), and scores each completion with the task's
verifier: 1.0 for a correct answer, else 0.0. A conversation about none of the benchmark's problems scores 0.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from agents.tasks import Problem, Task, get_task


@functools.cache
def _problems() -> tuple[Task, dict[str, Problem]]:
    spec = json.loads(open(os.environ["CHAT_LEARNING_TASK"]).read())
    task = get_task(spec["task"], **spec["options"])
    from bench.live_traffic import ask

    problems = task.problems(spec["n"], seed=spec["seed"])
    return task, {**{ask(p): p for p in problems}, **{p.prompt: p for p in problems}}


def reward(messages: list[dict[str, Any]], completions: list[str]) -> list[float]:
    task, by_prompt = _problems()
    asked = [m.get("content") for m in reversed(messages) if m.get("role") == "user"]
    problem = next((by_prompt[a] for a in asked if isinstance(a, str) and a in by_prompt), None)
    return [float(task.verify(problem, c).correct) if problem is not None else 0.0 for c in completions]
