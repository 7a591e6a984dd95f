"""SVR and SVR-R1 training rewards, computed from each turn's stored self-check (``learner.records.TurnCheck``).

**SVR** (self-verifying refinement; our reading of the method, ``docs/methods.md``): every turn ``t`` states an
answer, a verdict and a confidence; ``c_t`` is the verifier on that answer, ``q_t`` the stated P(correct)
(confidence after Correct, 1 − confidence after Incorrect). The turn's reward is ::

    r_t = w_c·c_t + w_v·(1 − (q_t − c_t)²) + w_s·stop_t
    stop_t = +b if the served agent would stop here (Correct, confidence ≥ τ) and c_t = 1
             −b' if it would stop here and c_t = 0 (a wrong stop), else 0
    unparsable turn: r_t = w_c·c_t − format_penalty (no verification or stop term)

≥ τ, not the spec's > τ: stop-ready means exactly the served policy's stop rule (``agents/stop.py``). The
rewards go on the turns (``Sample.reward``, source ``svr``) and the outcome is dropped (correctness is already
in every turn's reward); ``turn_grpo`` with ``source = "reward"`` then normalises each turn against the same turn
index of the group's other runs. Training runs are fixed-horizon (meta ``horizon``, ``agents/self_checks.py``):
turns after a right answer are scored too, so the model learns to keep it.

**SVR-R1** (binary self-verdict; a No buys a rethink, up to the stop policy's answer-turn ``cap``): one
trajectory reward over its T answer turns ::

    R = c_final + w_v·(1/T)·Σ_t 1[format_ok_t and (verdict_t = Yes) = c_t] + w_f·(1/T)·Σ_t 1[format_ok_t]
        + α·(c_last − c_first)          (correction shaping, only with two or more turns; α = 0 turns it off)

The verdict and format terms are shares of the turns, not counts: a run earns nothing for taking more turns
(with α = 0 a right first answer with Yes and a wrong → right run with No, Yes both score 1 + w_v + w_f), and
R lies in [−α, 1 + w_v + w_f + α]. The only term that sets a correction apart from a right first answer is the
SCoRe shaping α (Kumar et al. 2024, arXiv 2409.12917). The reward goes on ``Sample.trajectory_reward``
(source ``svr_r1``), turn rewards cleared, for a trajectory estimator (``grpo``).

A turn whose correctness was not measured (``correct`` None: no task problem) gives no reward: SVR leaves that
turn out (``turn_grpo`` excludes it), SVR-R1 the trajectory. Samples without a self-check keep their rewards.

Not here: parsing (``agents/stop.py``), the estimators (``learner/advantages.py``), making the runs
(``learner/svr_rollouts.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from learner.config import SVRConfig, SVRR1Config
from learner.records import TurnCheck
from learner.samples import Sample

__all__ = ["apply_self_check_rewards", "svr_r1_reward", "svr_turn_reward"]


def svr_turn_reward(check: TurnCheck, cfg: SVRConfig) -> float | None:
    """SVR's reward of one turn (module docstring); None when its correctness was not measured."""
    if check.correct is None:
        return None
    c = 1.0 if check.correct else 0.0
    q = check.p_correct
    if not check.format_ok or q is None or check.confidence is None:
        return cfg.w_c * c - cfg.format_penalty
    ready = check.verdict == "correct" and check.confidence >= cfg.tau
    stop = (cfg.b if check.correct else -cfg.b_wrong) if ready else 0.0
    return cfg.w_c * c + cfg.w_v * (1.0 - (q - c) ** 2) + cfg.w_s * stop


def svr_r1_reward(checks: Sequence[TurnCheck], cfg: SVRR1Config) -> float | None:
    """SVR-R1's trajectory reward over its answer turns in order (module docstring); None if any correctness is unmeasured."""
    if not checks or any(ch.correct is None for ch in checks):
        return None
    right = [1.0 if ch.correct else 0.0 for ch in checks]
    n = len(checks)
    matches = sum(1 for ch, c in zip(checks, right, strict=True) if ch.format_ok and ch.verdict is not None and (ch.verdict == "correct") == bool(c))
    fmt = sum(1 for ch in checks if ch.format_ok)
    shaping = cfg.alpha * (right[-1] - right[0]) if n > 1 else 0.0
    return right[-1] + cfg.w_v * matches / n + cfg.w_f * fmt / n + shaping


def apply_self_check_rewards(samples: Sequence[Sample], svr: SVRConfig, svr_r1: SVRR1Config) -> tuple[list[Sample], dict[str, Any]]:
    """The samples with SVR turn rewards or SVR-R1 trajectory rewards in place of their recorded ones (whichever is
    enabled; both off: unchanged). Returns the samples kept and counts: ``scored`` turns, ``adaptive`` turns of
    adaptive runs left out (``fixed_horizon_only``), ``unmeasured`` turns or trajectories without correctness."""
    info: dict[str, Any] = {"scored": 0, "adaptive": 0, "unmeasured": 0, "reward_mean": None}
    if not (svr.enabled or svr_r1.enabled):
        return list(samples), info
    out: list[Sample] = []
    values: list[float] = []
    if svr.enabled:
        for s in samples:
            if s.self_check is None or s.self_check.format != "svr":
                out.append(s)
                continue
            if svr.fixed_horizon_only and s.meta.get("horizon") is None:
                info["adaptive"] += 1
                continue
            r = svr_turn_reward(s.self_check, svr)
            info["scored" if r is not None else "unmeasured"] += 1
            if r is not None:
                values.append(r)
            out.append(
                dataclasses.replace(
                    s, reward=r, reward_source="svr" if r is not None else None, trajectory_reward=None, trajectory_reward_source=None
                )
            )
    else:
        by_traj: dict[str, list[Sample]] = {}
        for s in samples:
            by_traj.setdefault(s.trajectory_id, []).append(s)
        for members in by_traj.values():
            ordered = sorted(members, key=lambda x: x.turn_index)
            checks = [s.self_check for s in ordered if s.self_check is not None and s.self_check.format == "svr_r1"]
            if not checks:
                out += members
                continue
            r = svr_r1_reward(checks, svr_r1)
            if r is None:
                info["unmeasured"] += 1
                continue
            info["scored"] += len(members)
            values.append(r)
            out += [dataclasses.replace(s, reward=None, reward_source=None, trajectory_reward=r, trajectory_reward_source="svr_r1") for s in members]
    info["reward_mean"] = sum(values) / len(values) if values else None
    return out, info
