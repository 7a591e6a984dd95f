"""Per-turn self-checks on the record, and the fixed-horizon training runs of the self-verifying agents.

* :func:`turn_check` — what a self-verifying turn (``svr`` / ``svr_r1`` format) says about itself, as the
  record type :class:`learner.records.TurnCheck`: the answer it states, its verdict and confidence (as
  ``agents.stop`` parses them), and the task verifier's judgment of that answer (``correct``), so the
  learner computes SVR / SVR-R1 turn rewards and calibration from the store alone
  (``learner/svr_rewards.py``). The loop attaches it to the turn when it records the turn.
* :func:`fixed_horizon` — the policy of a *training* run (SVR, §5 of the spec: GRPO on fixed-horizon
  trajectories, adaptive stopping only at inference): the same format, system prompt and refinement
  feedback as the agent's own policy, but it never stops before the horizon, so every turn, also the ones
  after a right answer, gets a learning signal. The runs endpoint asks for one with ``horizon``.

Not here: parsing (``agents/stop.py``), rewards (``learner/svr_rewards.py``), running turns (``agents/loop.py``).
"""

from __future__ import annotations

from agents.stop import FixedPolicy, StopPolicy, extract_final_answer, parse_turn
from agents.tasks import Env, Problem, Task
from learner.records import TurnCheck


def turn_check(
    fmt: str, text: str, *, tool_calls: int = 0, task: Task | None = None, problem: Problem | None = None, env: Env | None = None
) -> TurnCheck | None:
    """The self-check of one turn in ``fmt`` (None: a plain-format agent, a tool turn, or an environment task).

    The stated answer is the parsed solution when the turn parsed, else the text ``extract_final_answer`` finds
    (what the policy would return); ``correct`` is ``task.verify`` on it when the run names a task problem."""
    if fmt not in ("svr", "svr_r1") or tool_calls or env is not None:
        return None
    check = parse_turn(text, fmt)  # type: ignore[arg-type]
    assert check is not None
    solution = check.solution if check.format_ok and check.solution is not None else (check.solution or extract_final_answer(text) or None)
    correct = task.verify(problem, solution or "").correct if task is not None and problem is not None else None
    return TurnCheck(
        format=fmt,
        solution=solution,
        verdict=check.verdict,
        confidence=check.confidence,
        format_ok=check.format_ok,
        error=check.error,
        correct=correct,
    )


def fixed_horizon(policy: StopPolicy) -> StopPolicy:
    """``policy`` as a training run's policy: run to the horizon (the run's ``max_turns``) with the same format,
    instructions and feedback; the answer is the last turn's. A plain-format policy gets the fixed policy's plain refinement."""
    fixed = FixedPolicy(fmt=policy.fmt, tau=float(getattr(policy, "tau", 0.7)))
    fixed.instructions = policy.instructions  # the exact system prompt of the adaptive agent (its think flag included)
    return fixed
