"""SVR's training data source and the adaptive agent's report (the eval gate's figures for a self-verifying agent).

* :func:`fixed_horizon_runs` — before an update, ``problems × group`` fixed-horizon runs (``"horizon": H`` on the
  runs endpoint: the agent's format and feedback, no early stop; ``agents/self_checks.py``) of the next training
  problems. They are recorded with their per-turn self-checks and train once they settle, scored by
  ``learner/svr_rewards.py``. The gate and the A/B still measure the adaptive agent (ordinary runs).
* :func:`adaptive_report` — what a set of runs (the gate's held-out runs) says about a self-verifying agent:
  accuracy, mean turns, the wrong-stop rate (among runs that stopped on their own verified self-check, the share
  whose answer was wrong), and the calibration of the stated P(correct) of the final answer (ECE over 10
  equal-width bins, Brier).

Not here: the rewards (``learner/svr_rewards.py``), the HTTP (``learner/runs_client.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from learner.config import SVRConfig
from learner.runs_client import RunOutcome, post_runs

__all__ = ["adaptive_report", "calibration_error", "fixed_horizon_runs"]


def fixed_horizon_runs(
    base_url: str,
    api_key: str | None,
    agent: str,
    cfg: SVRConfig,
    *,
    first_problem: int,
    sample_seed: int,
    concurrency: int = 8,
    model: str | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """Run problems ``first_problem ..`` (``cfg.problems_per_update`` of them, seed ``cfg.seed``) ``cfg.group`` times each
    at ``cfg.horizon`` turns (on ``model`` when given, else the agent's own); returns counts (runs, failed, correct,
    sampled tokens) and the first error."""
    extra = {"model": model} if model is not None else {}
    bodies = [
        {"problem_index": i, "seed": cfg.seed, "sample_seed": sample_seed + k, "horizon": cfg.horizon, **extra}
        for i in range(first_problem, first_problem + cfg.problems_per_update)
        for k in range(cfg.group)
    ]
    outcomes = post_runs(base_url, api_key, agent, bodies, concurrency=concurrency, **kw) if bodies else []
    runs = [o for o in outcomes if isinstance(o, dict)]
    errors = [o for o in outcomes if isinstance(o, str)]
    return {
        "runs": len(runs),
        "failed": len(errors),
        "first_error": errors[0] if errors else None,
        "correct": sum(1 for r in runs if r.get("correct")),
        "sampled_tokens": sum(int(r.get("completion_tokens") or 0) for r in runs),
        "problems": [first_problem, first_problem + cfg.problems_per_update],
        "trajectory_ids": [str(r["trajectory_id"]) for r in runs if r.get("trajectory_id")],
    }


def calibration_error(confidences: Sequence[float], outcomes: Sequence[bool], n_bins: int = 10) -> float:
    """ECE: bins ``[i/n, (i+1)/n)`` (the last closed at 1), Σ_b (n_b/N)·|mean confidence_b − accuracy_b| = Σ_b |Σconf − Σout| / N."""
    if len(confidences) != len(outcomes) or not confidences:
        raise ValueError("calibration needs equally many confidences and outcomes, at least one")
    sums: dict[int, list[float]] = {}
    for c, o in zip(confidences, outcomes, strict=True):
        b = min(int(c * n_bins), n_bins - 1)
        acc = sums.setdefault(b, [0.0, 0.0])
        acc[0] += c
        acc[1] += 1.0 if o else 0.0
    return sum(abs(c - o) for c, o in sums.values()) / len(confidences)


def adaptive_report(runs: Sequence[RunOutcome]) -> dict[str, Any]:
    """Accuracy, mean turns, wrong-stop rate, ECE and Brier of a set of run results (failed runs counted, not scored)."""
    ok = [r for r in runs if isinstance(r, dict)]
    n = len(ok)
    correct = [bool(r.get("correct")) for r in ok]
    verified = [c for r, c in zip(ok, correct, strict=True) if r.get("stop_reason") == "verified"]
    stated = [(float(r["p_correct"]), c) for r, c in zip(ok, correct, strict=True) if isinstance(r.get("p_correct"), int | float)]
    return {
        "n": n,
        "failed": len(runs) - n,
        "accuracy": sum(correct) / n if n else None,
        "mean_turns": sum(int(r.get("turns") or 0) for r in ok) / n if n else None,
        "verified_stops": len(verified),
        "wrong_stop_rate": sum(1 for c in verified if not c) / len(verified) if verified else None,
        "n_calibrated": len(stated),
        "ece": calibration_error([p for p, _ in stated], [c for _, c in stated]) if stated else None,
        "brier": sum((p - (1.0 if c else 0.0)) ** 2 for p, c in stated) / len(stated) if stated else None,
    }
