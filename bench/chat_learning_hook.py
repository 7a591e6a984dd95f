"""The reward hook of ``bench/chat_learning.py``: the task's own check, as a user's ``module:function`` hook.

``reward(messages, completions)`` finds the problem whose prompt is the conversation's last user message
(the benchmark writes its task, options and seed to the file named by ``CHAT_LEARNING_TASK``) and scores
each completion with the task's verifier: 1.0 for a correct answer, else 0.0. A prompt that is not one of
the benchmark's problems scores 0.
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
    return task, {p.prompt: p for p in task.problems(spec["n"], seed=spec["seed"])}


def reward(messages: list[dict[str, Any]], completions: list[str]) -> list[float]:
    task, by_prompt = _problems()
    prompt = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), None)
    problem = by_prompt.get(prompt) if isinstance(prompt, str) else None
    return [float(task.verify(problem, c).correct) if problem is not None else 0.0 for c in completions]
